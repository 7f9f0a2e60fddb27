"""The worker loop's fault handling, run in this process with one worker (no Ray).

A ``LocalSession`` stands in for Ray Train: it keeps reported checkpoints in a folder and
hands the newest back on resume, as Ray does after a restart. The multi-worker versions
(a SIGKILLed worker, a hung collective) are in tests/distributed/test_faults.py.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from raytrain_app import checkpoint as ckpt
from raytrain_app.config import config_from_dict, config_to_dict
from raytrain_app.environment import detect_environment
from raytrain_app.loop import NonFiniteLossError, WorkerLoop, WorkerTask
from raytrain_app.plan import make_plan
from raytrain_app.workloads import model_factory, prepare_data

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT / "examples", ROOT / "tests" / "distributed" / "workloads"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

# Of a run's metrics, what an interrupted run must reproduce exactly (timings differ).
TIMING_KEYS = ("samples_per_s", "epoch_time_s")


class Crash(Exception):
    """Stands in for a worker dying right after a checkpoint was persisted."""


class LocalSession:
    """A one-worker WorkerSession that persists checkpoints like Ray Train does."""

    world_rank = 0
    world_size = 1
    mid_epoch_checkpoints = True

    def __init__(self, storage: Path, crash_after_checkpoints: int | None = None) -> None:
        self.storage = storage
        self.storage.mkdir(parents=True, exist_ok=True)
        self.crash_after = crash_after_checkpoints
        self.reports: list[dict] = []

    def device(self) -> torch.device:
        return torch.device("cpu")

    def prepare_model(self, module: nn.Module, strategy: str, ddp_kwargs: dict) -> nn.Module:
        return module

    def prepare_loader(self, loader):
        return loader

    def report(self, metrics: dict, checkpoint_dir: Path | None, name: str | None) -> None:
        self.reports.append({**metrics, "checkpoint": name if checkpoint_dir else None})
        if checkpoint_dir is None:
            return
        target, attempt = self.storage / name, 1
        while target.exists():  # the same step written again after a fallback, as in Ray
            target, attempt = self.storage / f"{name}-r{attempt}", attempt + 1
        shutil.copytree(checkpoint_dir, target)
        if self.crash_after is not None and len(self.checkpoints()) >= self.crash_after:
            raise Crash

    def checkpoints(self) -> list[Path]:
        return ckpt.checkpoints_newest_first(self.storage)

    @contextlib.contextmanager
    def restored_checkpoint(self) -> Iterator[Path | None]:
        found = self.checkpoints()
        yield found[0] if found else None

    def node_address(self) -> str:
        return "127.0.0.1"


def _task(tmp_path: Path, **train: object) -> WorkerTask:
    raw = {
        "experiment": {"name": "loop", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"target": "faults:build_model", "params": train.pop("model_params", {})},
        "data": {"target": "faults:build_data", "params": {"num_samples": 640}},
        "train": {"epochs": 3, "global_batch_size": 32, "lr": 0.01, **train},
        "scaling": {"num_workers": 1},
        "dataloader": {"num_workers": 0},
    }
    cfg = config_from_dict(raw)
    plan = make_plan(cfg, detect_environment())
    run_dir = tmp_path / "runs" / "loop"
    run_dir.mkdir(parents=True, exist_ok=True)
    return WorkerTask(
        config=config_to_dict(cfg),
        plan=plan,
        data=prepare_data(cfg.data, run_dir / "data", cfg.experiment.seed),
        model=model_factory(cfg.model),
        run_dir=str(run_dir),
    )


def _run(task: WorkerTask, session: LocalSession) -> tuple[dict, dict[str, torch.Tensor]]:
    loop = WorkerLoop(task, session)
    result = loop.run()
    return result, {k: v.clone() for k, v in loop.module.state_dict().items()}


def _without_timings(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in history]


def _assert_same_run(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    assert _without_timings(a[0]["history"]) == _without_timings(b[0]["history"])
    for key, tensor in a[1].items():
        assert torch.equal(tensor, b[1][key]), key


def test_a_crash_after_a_mid_epoch_checkpoint_resumes_at_the_exact_next_batch(tmp_path):
    params = {"model_params": {"dropout": 0.2}, "checkpoint_every_steps": 3}
    reference = _run(_task(tmp_path / "a", **params), LocalSession(tmp_path / "a" / "ckpt"))

    task = _task(tmp_path / "b", **params)
    storage = tmp_path / "b" / "ckpt"
    # 16 steps per epoch, checkpoints at steps 3, 6, 9, 12, 15, 16 (epoch end) and 18:
    # the 7th is 2 steps into epoch 2.
    with pytest.raises(Crash):
        _run(task, LocalSession(storage, crash_after_checkpoints=7))
    newest = LocalSession(storage).checkpoints()[0]
    state = ckpt.load_train_state(newest)
    assert (state["epoch"], state["step"], state["step_in_epoch"]) == (1, 18, 2)

    resumed = _run(task, LocalSession(storage))
    _assert_same_run(resumed, reference)  # bit for bit: weights, losses, lr, steps


def test_mid_epoch_checkpoints_are_taken_every_n_steps_and_not_reported_as_epochs(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    result, _ = _run(_task(tmp_path, checkpoint_every_steps=5, epochs=2), session)
    names = [r["checkpoint"] for r in session.reports if r["checkpoint"]]
    # 16 steps per epoch: steps 5, 10, 15, then the epoch-end checkpoint at 16, and so on.
    assert names == [
        ckpt.checkpoint_name(epoch, step)
        for epoch, step in [(0, 5), (0, 10), (0, 15), (1, 16), (1, 20), (1, 25), (1, 30), (2, 32)]
    ]
    assert [row["epoch"] for row in result["history"]] == [1, 2]


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    task = _task(tmp_path, checkpoint_every_steps=4)
    reference = _run(
        _task(tmp_path / "ref", checkpoint_every_steps=4), LocalSession(tmp_path / "r")
    )
    storage = tmp_path / "ckpt"
    with pytest.raises(Crash):
        _run(task, LocalSession(storage, crash_after_checkpoints=3))
    newest, previous = LocalSession(storage).checkpoints()[:2]
    model_file = newest / ckpt.MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])

    with caplog.at_level("WARNING"):
        resumed = _run(task, LocalSession(storage))
    assert f"checkpoint '{newest}' is damaged: model.pt has" in caplog.text
    assert f"resuming from the older checkpoint {previous}" in caplog.text
    _assert_same_run(resumed, reference)


def test_a_torn_checkpoint_without_a_manifest_is_never_loaded(tmp_path):
    task = _task(tmp_path, checkpoint_every_steps=4, epochs=1)
    storage = tmp_path / "ckpt"
    with pytest.raises(Crash):
        _run(task, LocalSession(storage, crash_after_checkpoints=1))
    (LocalSession(storage).checkpoints()[0] / ckpt.MANIFEST_FILE).unlink()  # killed mid-write
    with pytest.raises(ckpt.DamagedCheckpointError, match="manifest.json is missing"):
        _run(task, LocalSession(storage))


def test_nonfinite_stop_names_the_step_and_writes_no_checkpoint_of_it(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    task = _task(tmp_path, checkpoint_every_steps=2, model_params={"nan_at_calls": [7]})
    with pytest.raises(NonFiniteLossError, match=r"at step 7 \(epoch 1, step 7 of 16\)"):
        _run(task, session)
    saved_steps = [ckpt.read_meta(c)["step"] for c in session.checkpoints()]
    assert max(saved_steps) == 6  # the checkpoint before the NaN, none after it


def test_nonfinite_skip_drops_that_step_and_counts_it(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    task = _task(tmp_path, on_nonfinite="skip", model_params={"nan_at_calls": [7, 30]})
    result, weights = _run(task, session)
    history = result["history"]
    assert [row["skipped_steps"] for row in history] == [1, 1, 0]
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert all(torch.isfinite(torch.tensor(row["train_loss"])) for row in history)
    assert history[-1]["train_loss"] < history[0]["train_loss"]  # still learning
    assert ckpt.load_train_state(session.checkpoints()[0])["skipped_steps"] == 2


def test_a_stop_request_checkpoints_at_the_next_step_and_resumes_exactly(tmp_path):
    reference = _run(_task(tmp_path / "a"), LocalSession(tmp_path / "a" / "ckpt"))
    task = _task(tmp_path / "b", model_params={"sleep_s": 0.002})
    task.stop_file = str(tmp_path / "stop")
    Path(task.stop_file).touch()  # asked before the first step: stops after it
    storage = tmp_path / "b" / "ckpt"
    result, _ = _run(task, LocalSession(storage))
    assert result["stopped"] is True
    [only] = LocalSession(storage).checkpoints()
    assert ckpt.read_meta(only)["step"] == 1

    Path(task.stop_file).unlink()
    resumed = _run(_task(tmp_path / "b"), LocalSession(storage))
    _assert_same_run(resumed, reference)
