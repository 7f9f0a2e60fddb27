"""Checkpoints saved in the background (``train.async_checkpoints``, on by default): the
step goes on while the files are written, and every guarantee of a checkpoint written on
the step's path holds.

A checkpoint step only waits for the save before it and copies the state into host
memory; the rank's writer thread serialises, digests and persists the copy. Run here in
this process (``InProcessSession`` persists into a folder as Ray Train does); the same
writer under Ray, killed mid-save, is tests/distributed/test_faults.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from loop_harness import LocalSession, make_task, run_loop
from torch import nn

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.direct_file import DigestingFile
from raytrain_app.checkpoint.snapshot import HostCopies
from raytrain_app.checkpoint.train_state import LoopState, Trainables
from raytrain_app.config import TrainConfig
from raytrain_app.worker.global_metrics import EpochProgress
from raytrain_app.worker.reporting import Reporter
from raytrain_app.worker.session import InProcessSession
from raytrain_app.worker.stop_request import StopRequest

CPU = torch.device("cpu")
HOLD_S = 5.0  # how long a held write waits at most for the test to release it


class HeldWrites:
    """``store.save_checkpoint`` held until ``release``: a write that takes as long as the
    test wants. Counts the writes running at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.released, self.started = threading.Event(), threading.Event()
        self.running = self.most_at_once = 0
        self._real = ckpt.save_checkpoint
        monkeypatch.setattr(ckpt, "save_checkpoint", self._held)

    def _held(self, *args, **kwargs):
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        self.started.set()
        try:
            self.released.wait(HOLD_S)
            return self._real(*args, **kwargs)
        finally:
            self.running -= 1

    def release(self) -> None:
        self.released.set()


def _trainables() -> Trainables:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Trainables(model, model, optimizer, scheduler, scaler, ema=None, lr=0.1)


def _train(t: Trainables, steps: int = 1) -> None:
    """Optimizer steps, which change the weights and AdamW's moments in place."""
    for _ in range(steps):
        t.model(torch.randn(16, 4)).square().mean().backward()
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad()


def _reporter(session: InProcessSession, **train) -> Reporter:
    return Reporter(session, TrainConfig(**train), {}, 1, CPU, timeout_s=60)


def _checkpoint(reporter: Reporter, t: Trainables, step: int) -> float:
    row = {"epoch": 0, "step": step, "mid_epoch": 1}
    return reporter.report(row, True, LoopState(step=step), t, EpochProgress(CPU))


def _copy_of(t: Trainables) -> tuple[dict, dict]:
    moments = {i: s["exp_avg"].clone() for i, s in enumerate(t.optimizer.state.values())}
    return {k: v.clone() for k, v in t.model.state_dict().items()}, moments


def _assert_holds(saved, weights: dict, moments: dict, step: int) -> None:
    """The checkpoint ``saved`` holds ``weights`` and AdamW's ``moments`` (``_copy_of``)
    as they were at optimizer step ``step``."""
    for key, tensor in ckpt.load_tensors(saved / ckpt.MODEL_FILE).items():
        assert torch.equal(tensor, weights[key]), key
    optimizer = ckpt.load_train_state(saved)["optimizer"]
    for i, expected in moments.items():
        assert torch.equal(optimizer["state"][i]["exp_avg"], expected)
    assert optimizer["state"][0]["step"].item() == step


def test_training_goes_on_while_a_checkpoint_is_written_and_it_holds_its_own_step(
    tmp_path, monkeypatch
):
    writes = HeldWrites(monkeypatch)
    session = InProcessSession(tmp_path / "ckpt")
    reporter, t = _reporter(session), _trainables()
    _train(t)
    weights, moments = _copy_of(t)
    blocked = _checkpoint(reporter, t, step=1)
    # Back at the step with the files still being written: only the snapshot blocked it.
    assert blocked < HOLD_S / 2 and writes.started.wait(HOLD_S) and writes.running == 1
    assert session.checkpoints() == []
    _train(t, steps=3)  # the weights and moments the snapshot copied change in place
    assert not torch.equal(t.model.state_dict()["0.weight"], weights["0.weight"])
    writes.release()
    reporter.finish()
    [saved] = session.checkpoints()
    ckpt.verify_checkpoint(saved)
    _assert_holds(saved, weights, moments, step=1)
    assert ckpt.read_meta(saved)["saving"]["background"] is True


def test_the_first_checkpoints_host_memory_is_set_aside_ahead_and_holds_its_own_step(tmp_path):
    """After the first optimizer step the writer allocates the host copies (``prepare``),
    so that the first checkpoint only refills them; what it saves is its own step's state,
    never what was copied ahead."""
    session = InProcessSession(tmp_path / "ckpt")
    reporter, t = _reporter(session), _trainables()
    _train(t)
    reporter.prepare(lambda: t)
    reporter.prepare(lambda: pytest.fail("asked again"))  # once: later calls do nothing
    reporter.writer.wait()
    set_aside = reporter._copy._stager._cached_storage_mapping
    moments = [s[name] for s in t.optimizer.state.values() for name in ("exp_avg", "exp_avg_sq")]
    for tensor in [*t.model.state_dict().values(), *moments]:
        assert tensor.untyped_storage() in set_aside
    _train(t, steps=2)  # what was copied ahead is stale now
    weights, moments = _copy_of(t)
    _checkpoint(reporter, t, step=3)
    reporter.finish()
    [saved] = session.checkpoints()
    _assert_holds(saved, weights, moments, step=3)
    reporter.close()


def test_the_loop_sets_the_host_memory_aside_once_after_its_first_step(tmp_path, monkeypatch):
    prepared = []
    real_prepare = HostCopies.prepare

    def recorded(self, state, device):
        prepared.append(bool(state["optimizer"]["state"]))  # AdamW's moments exist
        return real_prepare(self, state, device)

    monkeypatch.setattr(HostCopies, "prepare", recorded)
    result, _ = run_loop(make_task(tmp_path), LocalSession(tmp_path / "ckpt"))
    assert prepared == [True]
    assert result["history"], "the loop trained"


def test_a_failure_to_set_the_host_memory_aside_costs_only_the_time(tmp_path, monkeypatch, caplog):
    session = InProcessSession(tmp_path / "ckpt")
    reporter, t = _reporter(session), _trainables()
    _train(t)
    real_call = HostCopies.__call__
    calls = []

    def out_of_memory_once(self, state):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("cannot allocate memory")
        return real_call(self, state)

    monkeypatch.setattr(HostCopies, "__call__", out_of_memory_once)
    reporter.prepare(lambda: t)
    _checkpoint(reporter, t, step=1)  # waits for prepare, which failed quietly
    reporter.finish()
    [saved] = session.checkpoints()
    ckpt.verify_checkpoint(saved)
    assert "was not set aside ahead: cannot allocate memory" in caplog.text
    reporter.close()


def test_one_save_in_flight_the_next_checkpoint_waits_for_it_and_counts_the_wait(
    tmp_path, monkeypatch
):
    writes = HeldWrites(monkeypatch)
    session = InProcessSession(tmp_path / "ckpt")
    reporter, t = _reporter(session), _trainables()
    _checkpoint(reporter, t, step=1)
    blocked: list[float] = []
    second = threading.Thread(target=lambda: blocked.append(_checkpoint(reporter, t, step=2)))
    second.start()
    time.sleep(0.5)
    assert second.is_alive(), "the second checkpoint did not wait for the first save"
    writes.release()
    second.join(HOLD_S)
    reporter.finish()
    assert writes.most_at_once == 1
    assert blocked[0] >= 0.5  # the wait for the save in flight is time the step was blocked
    second_saved, first_saved = session.checkpoints()
    assert [second_saved.name, first_saved.name] == [
        ckpt.checkpoint_name(0, 2),
        ckpt.checkpoint_name(0, 1),
    ]
    # Each checkpoint's meta.json says how long its step waited for the save before it.
    assert ckpt.read_meta(second_saved)["saving"]["waited_s"] >= 0.5
    assert ckpt.read_meta(first_saved)["saving"]["waited_s"] < 0.5


def test_a_save_that_fails_mid_write_leaves_no_checkpoint_and_fails_the_run(tmp_path, monkeypatch):
    session = InProcessSession(tmp_path / "ckpt")
    reporter, t = _reporter(session), _trainables()
    _checkpoint(reporter, t, step=1)
    reporter.finish()
    real_write = DigestingFile.write

    def disk_full_after_the_weights(file, data):
        if Path(file.name).name.startswith(ckpt.TRAIN_STATE_FILE):
            raise OSError(28, "No space left on device")
        return real_write(file, data)

    monkeypatch.setattr(DigestingFile, "write", disk_full_after_the_weights)
    _checkpoint(reporter, t, step=2)  # returns: the failure comes in the writer
    with pytest.raises(OSError, match="No space left"):
        reporter.finish()
    [newest] = session.checkpoints()  # the failed one is nowhere, the previous one whole
    assert newest.name == ckpt.checkpoint_name(0, 1)
    ckpt.verify_checkpoint(newest)
    assert not list(tmp_path.glob("**/*.partial")), "the failed save's files were left"
    reporter.close()


def test_without_async_checkpoints_the_step_waits_for_the_files(tmp_path, monkeypatch):
    session = InProcessSession(tmp_path / "ckpt")
    reporter, t = _reporter(session, async_checkpoints=False), _trainables()
    _checkpoint(reporter, t, step=1)
    assert [p.name for p in session.checkpoints()] == [ckpt.checkpoint_name(0, 1)]


def test_a_stop_waits_for_the_save_in_flight_and_the_run_ends_with_it_whole(tmp_path, monkeypatch):
    writes = HeldWrites(monkeypatch)
    threading.Timer(1.0, writes.release).start()  # the stop's save takes a second
    monkeypatch.setattr(StopRequest, "requested", lambda self: True)
    storage = tmp_path / "ckpt"
    result, _ = run_loop(make_task(tmp_path), LocalSession(storage))
    assert result["stopped"] is True
    [stopped_at] = LocalSession(storage).checkpoints()
    ckpt.verify_checkpoint(stopped_at)
    assert ckpt.read_meta(stopped_at)["step"] == 1


def test_a_run_whose_last_checkpoint_cannot_be_written_fails(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_checkpoint", fails)
    with pytest.raises(OSError, match="No space left"):
        run_loop(make_task(tmp_path, epochs=1), LocalSession(tmp_path / "ckpt"))
