"""Runs the worker loop in this process with one worker, without Ray.

``LocalSession`` stands in for Ray Train: it keeps reported checkpoints in a folder and
hands the newest back on resume, as Ray does after a restart.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.config import config_from_dict, config_to_dict
from raytrain_app.planning.environment import detect_environment
from raytrain_app.planning.rules import make_plan
from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.workloads import model_factory, prepare_data

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


def make_task(tmp_path: Path, **train: object) -> WorkerTask:
    sections = {key: train.pop(key) for key in ("optimizations", "model") if key in train}
    raw = {
        "experiment": {"name": "loop", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": sections.pop(
            "model", {"target": "faults:build_model", "params": train.pop("model_params", {})}
        ),
        "data": {"target": "faults:build_data", "params": {"num_samples": 640}},
        "train": {"epochs": 3, "global_batch_size": 32, "lr": 0.01, **train},
        "scaling": {"num_workers": 1},
        "dataloader": {"num_workers": 0},
        **sections,
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


def run_loop(task: WorkerTask, session: LocalSession) -> tuple[dict, dict[str, torch.Tensor]]:
    loop = WorkerLoop(task, session)
    result = loop.run()
    return result, {k: v.clone() for k, v in loop.module.state_dict().items()}


def without_timings(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in history]


def assert_same_run(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    assert without_timings(a[0]["history"]) == without_timings(b[0]["history"])
    for key, tensor in a[1].items():
        assert torch.equal(tensor, b[1][key]), key
