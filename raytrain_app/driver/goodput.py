"""summary.json's ``goodput``: every second of the run's wall time, by what it went to.

The driver sees the run from its start to its summary; rank 0 of each worker group (each
attempt: the first, and one more after every restart) accounts for its own time from its
first step (``worker.goodput``) and sends the account to the driver's run control as it
goes (``driver.run_control``), the last one in its result. The parts:

- ``startup_s``: from the run's start (``run_clock``: the ``raytrain`` command's first
  import, or ``train()``'s call from Python) to the first attempt's first step;
- ``data_wait_s``, ``compute_s``, ``checkpoint_s``, ``validation_s``: rank 0's, summed over
  the attempts (ranks move in step through each step's all-reduce, so rank 0's steps are
  the run's: a rank late with its data holds rank 0 in the all-reduce, which it counts as
  compute; every worker's own data-wait share is a live metric, ``worker.live_metrics``);
- ``restart_s``: from an attempt's last account (sent every ``telemetry.INTERVAL_S`` while
  it steps and before each checkpoint: a failure in the middle of a long validation counts
  that validation here) to the next attempt's first step;
- ``lost_work_s``: the steps a failed attempt trained past the checkpoint the next one
  resumed from, at that attempt's mean step time (taken out of its compute and data wait);
- ``other_s``: the rest: the loop's bookkeeping between steps, what follows the last step
  (the result, the summary).

Times across processes are wall-clock stamps: the driver's and rank 0's nodes' clocks are
taken to agree (NTP); a skew moves seconds between start-up, restarts and ``other_s``.
"""

from __future__ import annotations

from typing import Any

from raytrain_app.worker.goodput import WORKER_PARTS

GOODPUT_PARTS = (
    "startup_s",
    "data_wait_s",
    "compute_s",
    "checkpoint_s",
    "validation_s",
    "restart_s",
    "lost_work_s",
    "other_s",
)
_LABELS = {
    "startup_s": "start-up",
    "data_wait_s": "data wait",
    "compute_s": "compute",
    "checkpoint_s": "checkpoint",
    "validation_s": "validation",
    "restart_s": "restart",
    "lost_work_s": "lost work",
    "other_s": "other",
}


def attempts_of(returned: dict[str, Any], sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every attempt's latest account, oldest first: those rank 0 sent the run control
    (``sent``), the last attempt's from its result (``returned["goodput"]``)."""
    latest = {record["attempt"]: record for record in sent if record.get("began_at")}
    final = returned.get("goodput")
    if final and final.get("began_at"):
        latest[final["attempt"]] = final
    return sorted(latest.values(), key=lambda record: record["began_at"])


def run_goodput(wall_s: float, ended_at: float, attempts: list[dict[str, Any]]) -> dict[str, float]:
    """The seconds of each part of ``wall_s``, the run's wall time ending at ``ended_at``
    (wall clock), from its ``attempts`` (``attempts_of``); they sum to ``wall_s``."""
    started_at = ended_at - wall_s
    out = dict.fromkeys(GOODPUT_PARTS, 0.0)
    if not attempts:  # no step was taken: all of it was start-up
        out["startup_s"] = wall_s
        return out
    out["startup_s"] = attempts[0]["began_at"] - started_at
    for index, attempt in enumerate(attempts):
        parts = dict(attempt["parts"])
        if index + 1 < len(attempts):
            following = attempts[index + 1]
            out["lost_work_s"] += _take_lost_work(parts, attempt, following["first_step"])
            out["restart_s"] += following["began_at"] - attempt["at"]
        for part in (*WORKER_PARTS, "other_s"):
            out[part] += parts[part]
    out["other_s"] += ended_at - attempts[-1]["at"]
    return {part: max(0.0, seconds) for part, seconds in out.items()}


def _take_lost_work(parts: dict[str, float], attempt: dict[str, Any], resumed_at: int) -> float:
    """The seconds of ``attempt``'s steps past ``resumed_at`` (trained again by the next
    attempt), moved out of its compute and data wait in their proportion."""
    lost_steps = max(0, attempt["step"] - resumed_at)
    stepping = parts["compute_s"] + parts["data_wait_s"]
    if not (lost_steps and attempt["steps"] and stepping):
        return 0.0
    lost = min(stepping, lost_steps * stepping / attempt["steps"])
    for part in ("compute_s", "data_wait_s"):
        parts[part] -= lost * parts[part] / stepping
    return lost


def goodput_line(goodput: dict[str, float]) -> str:
    """The parts' shares of the wall time, largest first: ``compute 71%, start-up 20%, ...``
    (parts under 0.5 % left out)."""
    total = sum(goodput.get(part, 0.0) for part in GOODPUT_PARTS)
    if total <= 0:
        return "no time measured"
    shares = sorted(
        ((goodput.get(part, 0.0) / total, part) for part in GOODPUT_PARTS), reverse=True
    )
    return ", ".join(f"{_LABELS[part]} {share:.0%}" for share, part in shares if share >= 0.005)
