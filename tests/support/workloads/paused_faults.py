"""The ``faults`` workload, waiting before its kill until the checkpoint it resumes from is safe.

Checkpoints are written in the background, and Ray Train collects reports on a poll: a
kill a few steps after a checkpoint would race both, and the restart would begin from the
checkpoint before. Before the kill, the killed rank waits until the checkpoint of step
``await_step`` (or later) is complete on disk in ``checkpoints_dir``, and, on Ray, until
Ray's checkpoint bookkeeping (``checkpoint_manager_snapshot.json`` there, the run's
``checkpoints/<experiment.name>``) names it, so the restart's checkpoint is known.
``ray_bookkeeping: false`` skips the second wait, for a run without Ray (local mode).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import faults
from faults import build_data

from raytrain_app import ModelSpec
from raytrain_app.checkpoint.store import checkpoints_newest_first, is_valid_checkpoint, read_meta

__all__ = ["build_data", "build_model"]

_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's own file, rewritten per report
_WAIT_S = 120.0


def build_model(params: dict, data_info: dict) -> ModelSpec:
    spec = faults.build_model(params, data_info)
    calls = 0

    def step(model, batch):
        nonlocal calls
        if model.training:
            calls += 1
            due = calls == params.get("kill_at_call") and not Path(params["marker"]).exists()
            if due and faults._rank() == params.get("kill_rank"):
                _await_safe_checkpoint(
                    Path(params["checkpoints_dir"]),
                    int(params["await_step"]),
                    ray_bookkeeping=params.get("ray_bookkeeping", True),
                )
        return spec.step(model, batch)

    return ModelSpec(module=spec.module, step=step)


def _await_safe_checkpoint(checkpoints_dir: Path, step: int, ray_bookkeeping: bool) -> None:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        written = _newest_complete(checkpoints_dir)
        saved = written is not None and read_meta(written)["step"] >= step
        if saved and (not ray_bookkeeping or _ray_recorded(checkpoints_dir) == written.name):
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of step {step} was saved and recorded: {checkpoints_dir}")


def _newest_complete(checkpoints_dir: Path) -> Path | None:
    for directory in checkpoints_newest_first(checkpoints_dir):
        if is_valid_checkpoint(directory):
            return directory
    return None


def _ray_recorded(checkpoints_dir: Path) -> str | None:
    try:
        snapshot = json.loads((checkpoints_dir / _SNAPSHOT).read_text())
        return snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]
    except (OSError, ValueError, KeyError, TypeError):  # not written yet, or mid-rewrite
        return None
