"""The ``faults`` workload, pausing before its kill so Ray has taken every report so far.

Ray Train collects reports on a poll; a kill a few milliseconds after a checkpoint would
race it. ``pause_before_kill_s`` (default 1 s) makes the restart's checkpoint predictable.
"""

from __future__ import annotations

import time
from pathlib import Path

import faults
from faults import build_data

from raytrain_app import ModelSpec

__all__ = ["build_data", "build_model"]


def build_model(params: dict, data_info: dict) -> ModelSpec:
    spec = faults.build_model(params, data_info)
    calls = 0

    def step(model, batch):
        nonlocal calls
        if model.training:
            calls += 1
            due = calls == params.get("kill_at_call") and not Path(params["marker"]).exists()
            if due and faults._rank() == params.get("kill_rank"):
                time.sleep(float(params.get("pause_before_kill_s", 1.0)))
        return spec.step(model, batch)

    return ModelSpec(module=spec.module, step=step)
