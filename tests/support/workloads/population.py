"""The ``faults`` workload, whose Tune trials wait for each other at their first step.

PBT exploits only among trials that are running: a trial that finishes before the other
starts (one process slower to start on a busy machine) has no one to exploit. With
``population`` (the number of trials) and ``population_dir`` (a folder every trial can
write), each trial's first training step waits until that many trials have begun, so the
population trains side by side. A trial continued from a checkpoint passes at once.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import faults
from faults import build_data

from raytrain_app import ModelSpec

__all__ = ["build_data", "build_model"]

_WAIT_S = 120.0


def build_model(params: dict, data_info: dict) -> ModelSpec:
    spec = faults.build_model(params, data_info)
    waited = False

    def step(model, batch):
        nonlocal waited
        if model.training and not waited:
            waited = True
            _wait_for_population(Path(params["population_dir"]), int(params["population"]))
        return spec.step(model, batch)

    return ModelSpec(module=spec.module, step=step)


def _wait_for_population(folder: Path, population: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{os.getpid()}-{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + _WAIT_S
    while len(list(folder.iterdir())) < population and time.monotonic() < deadline:
        time.sleep(0.05)
