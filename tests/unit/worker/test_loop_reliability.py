"""The worker loop's fault handling, run in this process with one worker (no Ray).

The multi-worker versions (a SIGKILLed worker, a hung collective, the driver's signals) are
in tests/distributed/test_faults.py.
"""

from __future__ import annotations

import pytest
import torch
from log_lines import log_lines
from loop_harness import Crash, LocalSession, assert_same_run, make_task, run_loop

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.worker import loop as loop_module
from raytrain_app.worker.loop import NonFiniteLossError
from raytrain_app.worker.step import OptimizerStep
from raytrain_app.worker.stop_request import StopRequest


def test_a_crash_after_a_mid_epoch_checkpoint_resumes_at_the_exact_next_batch(tmp_path):
    params = {"model_params": {"dropout": 0.2}, "checkpoint_every_steps": 3}
    reference = run_loop(make_task(tmp_path / "a", **params), LocalSession(tmp_path / "a" / "ckpt"))

    task = make_task(tmp_path / "b", **params)
    storage = tmp_path / "b" / "ckpt"
    # 16 steps per epoch, checkpoints at steps 3, 6, 9, 12, 15, 16 (epoch end) and 18:
    # the 7th is 2 steps into epoch 2.
    with pytest.raises(Crash):
        run_loop(task, LocalSession(storage, crash_after_checkpoints=7))
    newest = LocalSession(storage).checkpoints()[0]
    state = ckpt.load_train_state(newest)
    assert (state["epoch"], state["step"], state["step_in_epoch"]) == (1, 18, 2)

    resumed = run_loop(task, LocalSession(storage))
    assert_same_run(resumed, reference)  # bit for bit: weights, losses, lr, steps


def test_mid_epoch_checkpoints_are_taken_every_n_steps_and_not_reported_as_epochs(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    result, _ = run_loop(make_task(tmp_path, checkpoint_every_steps=5, epochs=2), session)
    names = [r["checkpoint"] for r in session.reports if r["checkpoint"]]
    # 16 steps per epoch: steps 5, 10, 15, then the epoch-end checkpoint at 16, and so on.
    assert names == [
        ckpt.checkpoint_name(epoch, step)
        for epoch, step in [(0, 5), (0, 10), (0, 15), (1, 16), (1, 20), (1, 25), (1, 30), (2, 32)]
    ]
    assert [row["epoch"] for row in result["history"]] == [1, 2]


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    task = make_task(tmp_path, checkpoint_every_steps=4)
    reference = run_loop(
        make_task(tmp_path / "ref", checkpoint_every_steps=4), LocalSession(tmp_path / "r")
    )
    storage = tmp_path / "ckpt"
    with pytest.raises(Crash):
        run_loop(task, LocalSession(storage, crash_after_checkpoints=3))
    newest, previous = LocalSession(storage).checkpoints()[:2]
    model_file = newest / ckpt.MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])

    with log_lines("raytrain_app") as lines:
        resumed = run_loop(task, LocalSession(storage))
    logged = "\n".join(lines)
    assert f"checkpoint '{newest}' is damaged: model.pt has" in logged
    assert f"resuming from the older checkpoint {previous}" in logged
    assert_same_run(resumed, reference)


def test_a_torn_checkpoint_without_a_manifest_is_never_loaded(tmp_path):
    task = make_task(tmp_path, checkpoint_every_steps=4, epochs=1)
    storage = tmp_path / "ckpt"
    with pytest.raises(Crash):
        run_loop(task, LocalSession(storage, crash_after_checkpoints=1))
    (LocalSession(storage).checkpoints()[0] / ckpt.MANIFEST_FILE).unlink()  # killed mid-write
    with pytest.raises(ckpt.DamagedCheckpointError, match="manifest.json is missing"):
        run_loop(task, LocalSession(storage))


def test_nonfinite_stop_names_the_step_and_writes_no_checkpoint_of_it(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    task = make_task(tmp_path, checkpoint_every_steps=2, model_params={"nan_at_calls": [7]})
    with pytest.raises(NonFiniteLossError, match=r"at step 7 \(epoch 1, step 7 of 16\)"):
        run_loop(task, session)
    saved_steps = [ckpt.read_meta(c)["step"] for c in session.checkpoints()]
    assert max(saved_steps) == 6  # the checkpoint before the NaN, none after it


def test_nonfinite_skip_drops_that_step_and_counts_it(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    task = make_task(tmp_path, on_nonfinite="skip", model_params={"nan_at_calls": [7, 30]})
    result, weights = run_loop(task, session)
    history = result["history"]
    assert [row["skipped_steps"] for row in history] == [1, 1, 0]
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert all(torch.isfinite(torch.tensor(row["train_loss"])) for row in history)
    assert history[-1]["train_loss"] < history[0]["train_loss"]  # still learning
    assert ckpt.load_train_state(session.checkpoints()[0])["skipped_steps"] == 2


def test_a_stop_request_checkpoints_at_the_next_step_and_resumes_exactly(tmp_path, monkeypatch):
    reference = run_loop(make_task(tmp_path / "a"), LocalSession(tmp_path / "a" / "ckpt"))
    task = make_task(tmp_path / "b", model_params={"sleep_s": 0.002})
    # The driver asked before the first step (its run-control actor says so): stops after it.
    monkeypatch.setattr(StopRequest, "requested", lambda self: True)
    storage = tmp_path / "b" / "ckpt"
    result, _ = run_loop(task, LocalSession(storage))
    assert result["stopped"] is True
    [only] = LocalSession(storage).checkpoints()
    assert ckpt.read_meta(only)["step"] == 1

    monkeypatch.undo()
    resumed = run_loop(make_task(tmp_path / "b"), LocalSession(storage))
    assert_same_run(resumed, reference)


class RecordedProgress:
    """Stands in for the driver's run-control actor: keeps the progress rank 0 pushed."""

    def __init__(self) -> None:
        self.pushed: list[dict] = []
        self.update = self  # called as ``progress.update.remote(**fields)``

    def remote(self, **fields) -> None:
        self.pushed.append(fields)


class StepClock:
    """``time.perf_counter`` for the loop: 1 s per optimizer step and nothing else, plus
    whatever a test adds (a restart's lost time), so an epoch's time is known exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_throughput_covers_the_whole_epoch_across_checkpoints_and_resumes(tmp_path, monkeypatch):
    """An epoch's samples/s is its samples over its training time, whether it was cut by
    mid-epoch checkpoints or resumed after a crash (the time lost in between excluded)."""
    clock = StepClock()
    monkeypatch.setattr(loop_module, "time", clock)
    forward_backward = OptimizerStep.forward_backward

    def one_second_per_step(self, *args, **kwargs):
        clock.now += 1.0
        return forward_backward(self, *args, **kwargs)

    monkeypatch.setattr(OptimizerStep, "forward_backward", one_second_per_step)
    task = make_task(tmp_path, checkpoint_every_steps=3)
    task.control, task.show_progress = RecordedProgress(), True
    monkeypatch.setattr(StopRequest, "requested", lambda self: False)  # no Ray to ask
    storage = tmp_path / "ckpt"
    with pytest.raises(Crash):  # the 7th checkpoint is 2 steps into epoch 2 (step 18)
        run_loop(task, LocalSession(storage, crash_after_checkpoints=7))
    clock.now += 1000.0  # the restart: not training time
    result, _ = run_loop(task, LocalSession(storage))

    steps_per_epoch, epoch_samples = 16, 16 * 32  # x global batch
    for row in result["history"]:  # epoch 2: 2 steps before the crash, 14 after the resume
        assert row["epoch_time_s"] == pytest.approx(steps_per_epoch)
        assert row["samples_per_s"] == pytest.approx(epoch_samples / steps_per_epoch)
    # The bar's rate at an epoch's last step is that epoch's rate, not the rate since the
    # last mid-epoch checkpoint (which was one step earlier).
    last_steps = [p for p in task.control.pushed if p["step"] == steps_per_epoch]
    for pushed, row in zip(last_steps[-3:], result["history"], strict=True):
        assert pushed["samples_per_s"] == pytest.approx(row["samples_per_s"])
