"""The ``faults`` workload, whose worker SIGKILLs itself while writing a checkpoint.

``kill_in_checkpoint_after_call`` (training micro-batches of ``kill_rank``, which must be
the rank that writes checkpoints: 0; one micro-batch a step) and ``marker``: the checkpoint
of that step is written into the run's storage one file only, once training has gone on
to the next micro-batch (at most a minute later: a save on the step's path would hold
training back), and the process is SIGKILLed, once (not when ``marker`` exists).
``marker`` gets the names in the ``.partial`` directory at that moment and the
micro-batches trained by then. The writing is the product's (torch.save into
``<name>.partial``, raytrain_app/checkpoint/upload.py); only the moment of the kill is
chosen here.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import faults
import torch
from faults import build_data

from raytrain_app import ModelSpec

__all__ = ["build_data", "build_model"]


def build_model(params: dict, data_info: dict) -> ModelSpec:
    spec = faults.build_model(params, data_info)
    marker = Path(params["marker"])
    calls = 0

    def step(model, batch):
        nonlocal calls
        if model.training:
            calls += 1
            due = calls == params["kill_in_checkpoint_after_call"] and not marker.exists()
            if due and faults._rank() == params.get("kill_rank", 0):
                _die_in_the_write_of(f"_step{calls:09d}.partial", marker, lambda: calls)
        return spec.step(model, batch)

    return ModelSpec(module=spec.module, step=step)


def _die_in_the_write_of(partial: str, marker: Path, trained: Callable[[], int]) -> None:
    """Make this process's write of the checkpoint into the directory ending in
    ``partial`` wait until ``trained()`` (micro-batches) has grown, write one file, then
    SIGKILL it as it starts the second."""
    save = torch.save
    before = trained()
    files = 0

    def write_one_file_and_die(obj, f, *args, **kwargs):
        nonlocal files
        # raytrain saves into a file object (checkpoint/store.py), named as open() names it.
        name = f if isinstance(f, str | os.PathLike) else getattr(f, "name", None)
        directory = Path(name).parent if name is not None else None
        if directory is None or not directory.name.endswith(partial):
            return save(obj, f, *args, **kwargs)
        if files:  # the weights are in: the second file dies with the process
            written = sorted(p.name for p in directory.iterdir())
            seen = {"partial": str(directory), "written": written, "trained": trained()}
            marker.write_text(json.dumps(seen))
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while trained() == before and time.monotonic() < deadline:
            time.sleep(0.01)  # the save is in flight while training goes on
        files += 1
        return save(obj, f, *args, **kwargs)

    torch.save = write_one_file_and_die
