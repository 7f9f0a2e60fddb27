"""Runs the worker loop in this process with one worker, without Ray.

``LocalSession`` is the product's ``InProcessSession`` (checkpoints kept in a folder, the
newest handed back on resume, as Ray does after a restart) that can also crash on cue.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
from environments import make_env

from raytrain_app.config import RaytrainConfig, config_from_dict, config_to_dict
from raytrain_app.planning.rules import make_plan
from raytrain_app.tracking.metrics_log import TIMING_COLUMNS
from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.worker.session import InProcessSession
from raytrain_app.workloads import model_factory, prepare_data

# Of a run's metrics, what an interrupted run must reproduce exactly (timings differ).
TIMING_KEYS = TIMING_COLUMNS


class Crash(Exception):
    """Stands in for a worker dying right after a checkpoint was persisted."""


class LocalSession(InProcessSession):
    """A one-worker session that persists checkpoints like Ray Train does, and can die
    right after its ``crash_after_checkpoints``-th persisted checkpoint."""

    def __init__(self, storage: Path, crash_after_checkpoints: int | None = None) -> None:
        storage.mkdir(parents=True, exist_ok=True)
        super().__init__(storage)
        self.crash_after = crash_after_checkpoints

    def report(self, metrics: dict, saved: Future | None, name: str | None) -> None:
        super().report(metrics, saved, name)
        if saved is None or self.crash_after is None:
            return
        saved.result()  # saved in the background: crash once it is persisted
        if len(self.checkpoints()) >= self.crash_after:
            raise Crash


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
    return worker_task(config_from_dict(raw), tmp_path / "runs" / "loop")


def worker_task(cfg: RaytrainConfig, run_dir: Path, data_dir: Path | None = None) -> WorkerTask:
    """What the driver would send a worker for ``cfg`` on a CPU machine, its data prepared
    in ``data_dir`` (default: the run directory's data/).

    Planned against an explicit CPU environment, never the host's: on a GPU host the plan
    would otherwise turn on bf16, compile and the fused optimizer in CPU tests."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return WorkerTask(
        config=config_to_dict(cfg),
        plan=make_plan(cfg, make_env()),
        data=prepare_data(cfg.data, data_dir or run_dir / "data", cfg.experiment.seed),
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
