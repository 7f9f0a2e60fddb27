"""A checkpoint's content as it was at the step it was taken, held in host memory, so
that training goes on while the writer (``writer.py``) serialises it.

``train_state.snapshot_resumable`` decides what goes in; this module holds it and writes
it: the plain files of ``store.py``, and with FSDP this rank's shards (``sharded.py``).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raytrain_app.checkpoint import sharded, store

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """What this rank writes of one checkpoint.

    ``model``, ``ema`` and ``train_state`` are what rank 0 writes (plain state dicts and
    values; ``{}``/None on the other ranks of a sharded checkpoint); ``shards`` is this
    rank's DCP state of a sharded (FSDP) model, None otherwise.
    """

    meta: dict[str, Any]
    model: dict[str, Any]
    train_state: dict[str, Any]
    ema: dict[str, Any] | None = None
    shards: dict[str, Any] | None = None

    def write(self, directory: Path, group: Any = None) -> None:
        """Write it into ``directory``, manifest last. A sharded checkpoint is written by
        every rank at once, its collectives over ``group`` (None: the default group)."""
        if self.shards is not None:
            sharded.write_sharded(
                directory,
                shards=self.shards,
                model_state=self.model,
                ema_state=self.ema,
                train_state=self.train_state,
                meta=self.meta,
                group=group,
            )
            return
        store.save_checkpoint(
            directory, model=self.model, train_state=self.train_state, meta=self.meta, ema=self.ema
        )


class HostCopies:
    """Copies state into host memory with DCP's stager, which keeps one buffer per tensor
    storage and refills it at the next checkpoint (pinned where the state is on a GPU,
    copied without blocking and waited for once); plain values are deep-copied. DTensor
    shards (FSDP) stay DTensors, their local shards copied.

    A buffer is refilled only after the save that read it has ended: the writer keeps at
    most one in flight.

    Built on ``StateDictStager``, the part of DCP's ``DefaultStager`` that copies, not on
    ``DefaultStager`` itself: torch 2.11's closes its stager after every ``stage`` (its
    buffers dropped, its copy table emptied), so a reused one fails at the second
    checkpoint with ``KeyError: <class 'type'>`` (pytorch/pytorch#183413; seen here on an
    H100 with torch 2.11) where torch 2.13's goes on. The stager's own ``stage`` is the
    same in both.
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._stager: Any = None

    def __call__(self, state: Any) -> Any:
        if self._stager is None:
            self._stager = _stager(self.pinned)
        copied = self._stager.stage(state, non_blocking=self.pinned)
        if self.pinned:  # the copies were queued on the GPU's stream: they are whole now
            torch.cuda.synchronize()
        return copied

    def prepare(self, state: Any, device: torch.device) -> None:
        """Allocate the buffers ``state``'s tensors are copied into at every checkpoint,
        ahead of the first one, in the writer's thread while training goes on: the first
        copy otherwise blocks its step for the allocation (and DCP's import) besides the
        copy: 1.8-3.1 s for 1.2 GB on a 2-core VM, against 0.15-0.4 s for a later one;
        page-locking GPU hosts' memory takes longer still. What is copied is discarded
        (training changes it meanwhile): only the buffers are kept, refilled by the
        checkpoints. A failure costs the first checkpoint that time, nothing else."""
        try:
            # The writer's thread starts on the first GPU: copy from (and wait for) the
            # training's own device.
            with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                self(state)
        except Exception as exc:  # the checkpoint that needs the buffers will say why
            logger.warning("host memory for checkpoints was not set aside ahead: %s", exc)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _stager(pinned: bool) -> Any:
    # Imported here: torch.distributed.checkpoint costs some 0.7 s of CPU to import, paid
    # only by a process that checkpoints in the background.
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    return StateDictStager(pin_memory=pinned, share_memory=False)  # read by a thread of ours
