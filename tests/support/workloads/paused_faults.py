"""The ``faults`` workload, waiting before its kill until Ray has taken the newest checkpoint.

Ray Train collects reports on a poll; a kill a few milliseconds after a checkpoint would
race it, and the restart would begin from the checkpoint before. Before the kill, the
killed rank waits until Ray's checkpoint bookkeeping (``checkpoint_manager_snapshot.json``
in ``checkpoints_dir``, the run's ``checkpoints/<experiment.name>``) names the newest
checkpoint on disk, so the restart's checkpoint is known.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import faults
from faults import build_data

from raytrain_app import ModelSpec
from raytrain_app.checkpoint.store import checkpoints_newest_first

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
                _await_ray_has_newest_checkpoint(Path(params["checkpoints_dir"]))
        return spec.step(model, batch)

    return ModelSpec(module=spec.module, step=step)


def _await_ray_has_newest_checkpoint(checkpoints_dir: Path) -> None:
    newest = checkpoints_newest_first(checkpoints_dir)[0].name
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        try:
            snapshot = json.loads((checkpoints_dir / _SNAPSHOT).read_text())
            latest = snapshot["latest_checkpoint_result"]
        except (OSError, ValueError, KeyError):  # not written yet, or mid-rewrite
            latest = None
        if latest and latest["checkpoint_dir_name"] == newest:
            return
        time.sleep(0.05)
    raise AssertionError(f"Ray never recorded {newest} in {checkpoints_dir / _SNAPSHOT}")
