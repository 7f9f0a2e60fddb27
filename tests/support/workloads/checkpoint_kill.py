"""The ``faults`` workload, whose worker SIGKILLs itself while copying a checkpoint.

``kill_in_checkpoint_after_call`` (training micro-batches of ``kill_rank``, which must be
the rank that writes checkpoints: 0) and ``marker``: the checkpoint written after that
micro-batch's step is copied into the run's storage one file only, once training has
gone on to the next micro-batch (at most a minute later: a save on the step's path would
hold training back), and the process is SIGKILLed, once (not when ``marker`` exists).
``marker`` gets the names in the ``.partial`` directory at that moment and the
micro-batches trained by then. The copy itself is pyarrow's, as in the product
(raytrain_app/checkpoint/upload.py); only the moment of the kill is chosen here.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import faults
import pyarrow.fs
from faults import build_data

from raytrain_app import ModelSpec
from raytrain_app.checkpoint.store import MANIFEST_FILE

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
                _die_in_the_next_copy(marker, lambda: calls)
        return spec.step(model, batch)

    return ModelSpec(module=spec.module, step=step)


def _die_in_the_next_copy(marker: Path, trained: Callable[[], int]) -> None:
    """Make this process's next checkpoint copy (into ``<name>.partial`` on a local
    filesystem) wait until ``trained()`` (micro-batches) has grown, write one file, then
    SIGKILL it."""
    copy_files = pyarrow.fs.copy_files
    before = trained()

    def copy_one_file_and_die(source: str, destination: str, **kwargs) -> None:
        if not destination.endswith(".partial"):  # not a checkpoint's upload
            return copy_files(source, destination, **kwargs)
        deadline = time.monotonic() + 60
        while trained() == before and time.monotonic() < deadline:
            time.sleep(0.01)  # the save is in flight while training goes on
        files = [p for p in Path(source).iterdir() if p.is_file()]
        # The weights first, the manifest (which marks a copy complete) never.
        first = min(files, key=lambda p: (p.name == MANIFEST_FILE, p.name))
        copy_files(str(first), f"{destination}/{first.name}", **kwargs)
        written = sorted(p.name for p in Path(destination).iterdir())
        seen = {"partial": destination, "written": written, "trained": trained()}
        marker.write_text(json.dumps(seen))
        os.kill(os.getpid(), signal.SIGKILL)

    pyarrow.fs.copy_files = copy_one_file_and_die
