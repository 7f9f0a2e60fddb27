"""summary.json's goodput (driver/goodput.py): the driver's start-up, restarts and lost work
with rank 0's accounts of each attempt, summing to the wall time."""

from __future__ import annotations

import pytest

from raytrain_app.driver.goodput import GOODPUT_PARTS, attempts_of, goodput_line, run_goodput


def _attempt(name, began_at, elapsed, first_step, step, steps, **parts):
    values = {"data_wait_s": 0.0, "compute_s": 0.0, "checkpoint_s": 0.0, "validation_s": 0.0}
    values.update(parts)
    values["other_s"] = elapsed - sum(values.values())
    return {
        "attempt": name,
        "began_at": began_at,
        "at": began_at + elapsed,
        "first_step": first_step,
        "step": step,
        "steps": steps,
        "elapsed_s": elapsed,
        "parts": values,
    }


def test_one_attempt_start_up_its_parts_and_the_end_sum_to_the_wall_time():
    # The run starts at 1000 and ends at 1030; the first step at 1008, the last account
    # at 1028 (the 2 s after it: the result and the summary).
    attempt = _attempt("a", 1008.0, 20.0, 0, 100, 100, compute_s=15, data_wait_s=1, validation_s=2)
    goodput = run_goodput(30.0, 1030.0, [attempt])
    assert goodput == pytest.approx(
        {
            "startup_s": 8.0,
            "data_wait_s": 1.0,
            "compute_s": 15.0,
            "checkpoint_s": 0.0,
            "validation_s": 2.0,
            "restart_s": 0.0,
            "lost_work_s": 0.0,
            "other_s": 4.0,
        }
    )
    assert sum(goodput.values()) == pytest.approx(30.0)


def test_a_failure_costs_the_restart_and_the_steps_trained_again():
    """The first attempt reached step 70 and failed; the second resumed from the step-60
    checkpoint: 10 of its 70 steps (1 s each, 0.8 compute, 0.2 data wait) were lost."""
    first = _attempt("a", 1005.0, 80.0, 0, 70, 70, compute_s=56, data_wait_s=14, checkpoint_s=4)
    second = _attempt("b", 1095.0, 50.0, 60, 140, 80, compute_s=40, data_wait_s=5)
    goodput = run_goodput(150.0, 1150.0, [first, second])
    assert goodput["startup_s"] == pytest.approx(5.0)
    assert goodput["restart_s"] == pytest.approx(10.0)  # from its last account at 1085
    assert goodput["lost_work_s"] == pytest.approx(10.0)
    assert goodput["compute_s"] == pytest.approx(56 - 8 + 40)
    assert goodput["data_wait_s"] == pytest.approx(14 - 2 + 5)
    assert sum(goodput.values()) == pytest.approx(150.0)
    assert set(goodput) == set(GOODPUT_PARTS)


def test_the_last_attempts_result_supersedes_what_it_sent_and_attempts_come_in_order():
    early = _attempt("a", 1010.0, 5.0, 0, 7, 7)
    sent_late = _attempt("b", 1020.0, 1.0, 5, 6, 1)
    final = _attempt("b", 1020.0, 9.0, 5, 20, 15)
    attempts = attempts_of({"goodput": final}, [sent_late, early])
    assert [(a["attempt"], a["step"]) for a in attempts] == [("a", 7), ("b", 20)]


def test_a_run_that_never_stepped_was_all_start_up():
    assert run_goodput(12.0, 1012.0, [])["startup_s"] == 12.0


def test_the_final_summary_line_shows_the_shares_largest_first():
    goodput = dict.fromkeys(GOODPUT_PARTS, 0.0)
    goodput.update(compute_s=7.0, startup_s=2.0, checkpoint_s=1.0, other_s=0.01)
    assert goodput_line(goodput) == "compute 70%, start-up 20%, checkpoint 10%"
