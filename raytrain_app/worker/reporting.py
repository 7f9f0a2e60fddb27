"""What a worker reports to Ray after an epoch or between steps, and the checkpoint that
goes with it: every rank reports (Ray needs equal counts), rank 0 checkpoints with every
rank's RNG and unfinished-epoch sums gathered into it (with FSDP every rank checkpoints
its shards besides).

A checkpoint blocks the step only while this rank waits for its save in flight and takes
a snapshot into host memory; the rank's writer (``checkpoint.writer``) serialises,
digests and persists it while training goes on.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raytrain_app.checkpoint.data_identity import IDENTITY_KEY
from raytrain_app.checkpoint.ranking import SCORE_KEY, checkpoint_score
from raytrain_app.checkpoint.sharded import is_sharded
from raytrain_app.checkpoint.snapshot import HostCopies, Snapshot
from raytrain_app.checkpoint.store import checkpoint_name
from raytrain_app.checkpoint.train_state import (
    LoopState,
    Trainables,
    copied_tensors,
    rng_state,
    snapshot_resumable,
)
from raytrain_app.checkpoint.writer import CheckpointWriter
from raytrain_app.config import TrainConfig
from raytrain_app.planning.lanes import STREAM_LANES_KEY
from raytrain_app.worker.global_metrics import EpochProgress, gather
from raytrain_app.worker.rank_zero import is_rank_zero
from raytrain_app.worker.session import WorkerSession

# meta.json's record of how a checkpoint was taken: in the background or not, and the
# seconds the step waited for the save before it and took to copy the state.
SAVING_KEY = "saving"


class Reporter:
    """Reports rows to the session; checkpoints them when due, one save in flight."""

    def __init__(
        self,
        session: WorkerSession,
        train: TrainConfig,
        meta: dict[str, Any],
        world_size: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.session, self.train, self.world_size = session, train, world_size
        self.meta = meta  # what every checkpoint's meta.json holds besides its progress
        background = train.async_checkpoints and session.background_saves
        self.writer = CheckpointWriter(background)
        # Saves written at once need no copy of the state: it cannot change before.
        self._copy = HostCopies(pinned=device.type == "cuda") if background else None
        self._device = device
        self._timeout_s = timeout_s  # of the writer's process group (FSDP)
        self._group: Any = None
        self._prepared = False

    def prepare(self, trainables: Callable[[], Trainables]) -> None:
        """Once, after the first optimizer step (when the optimizer's state exists): let
        the writer allocate the host copies of rank 0's checkpoints while training goes
        on (``HostCopies.prepare``), so that the first checkpoint blocks its step only for
        the copy. A sharded model's state is gathered with collectives, on the training
        thread only: its first checkpoint still allocates.

        Called after every step: ``trainables`` is asked for only the first time."""
        if self._prepared or self._copy is None:
            return
        self._prepared = True
        t = trainables()
        if is_rank_zero() and not is_sharded(t.model):
            sources = copied_tensors(t)  # references, taken on the training thread
            self.writer.submit(functools.partial(self._copy.prepare, sources, self._device))

    def report(
        self,
        row: dict[str, float],
        due: bool,
        state: LoopState,
        trainables: Trainables,
        progress: EpochProgress,
    ) -> float:
        """Report ``row`` on this rank; with ``due``, also checkpoint (rank 0, or every rank
        of a sharded model).

        Returns the seconds the checkpoint blocked training (0.0 without one): waiting for
        the save before it to end, taking the snapshot, and the report itself.
        """
        start = time.perf_counter()
        per_rank = {"rng": rng_state(), "epoch": progress.to_dict()} if due else None
        ranks = gather(per_rank, self.world_size) if due else None
        name = checkpoint_name(state.epoch, state.step) if due else None
        # Ray ranks checkpoints by this score (train.monitor / train.mode); see ranking.py.
        reported = {**row, SCORE_KEY: checkpoint_score(row, self.train.monitor, self.train.mode)}
        # A sharded (FSDP) model is checkpointed by every rank, each reporting its part.
        every_rank = due and is_sharded(trainables.model)
        checkpoint = None
        if every_rank or (due and is_rank_zero()):
            meta = {**self.meta, "epoch": state.epoch, "step": state.step, "metrics": row}
            waited = time.perf_counter()
            self.writer.wait()  # the save in flight: its snapshot's buffers are refilled now
            copied = time.perf_counter()
            snapshot = snapshot_resumable(trainables, state, ranks, meta, self._copy or _as_is)
            # How this checkpoint was taken, in its meta.json (benchmarks/checkpoint_stall.py).
            snapshot.meta[SAVING_KEY] = {
                "background": self.writer.background,
                "waited_s": copied - waited,  # for the save before it
                "snapshot_s": time.perf_counter() - copied,
            }
            checkpoint = self._save(snapshot, name, self._writer_group() if every_rank else None)
        self.session.report(reported, checkpoint, name)
        return time.perf_counter() - start if due else 0.0

    def _save(self, snapshot: Snapshot, name: str, group: Any) -> Future:
        """The writer's save: ``snapshot`` written where the session persists it."""
        write = functools.partial(snapshot.write, group=group)
        return self.writer.submit(functools.partial(self.session.persist, write, name, group))

    def _writer_group(self) -> Any:
        """The process group of the writers' collectives (a sharded checkpoint's), made by
        every rank at its first sharded checkpoint: the training's own group may be in use
        by the step at the same time. The training's group where saves are written at
        once, on the step's path."""
        if not self.writer.background:
            return dist.group.WORLD
        if self._group is None:
            timeout = timedelta(seconds=self._timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def finish(self) -> float:
        """Wait for the save in flight (the run's last checkpoint is whole before it ends);
        the seconds waited.

        Raises:
            Exception: that save failed.
        """
        start = time.perf_counter()
        self.writer.wait()
        return time.perf_counter() - start

    def close(self) -> None:
        """Let a save in flight end, raising nothing (the run is ending or failing), and
        free the writer and its host copies."""
        self.writer.close()
        if self._copy is not None:
            self._copy.close()


def _as_is(state: Any) -> Any:
    return state


def checkpoint_meta(task: Any, data_info: dict[str, Any]) -> dict[str, Any]:
    """The run's part of meta.json: factories by import path, data info, resolved config,
    and the files of data.path, which a resume compares with the data it finds."""
    meta = {
        "model_factory": asdict(task.model),
        "data_factory": asdict(task.data),
        "data_info": data_info,
        "config": task.config,
    }
    if task.data_identity is not None:
        meta[IDENTITY_KEY] = task.data_identity
    if task.stream_lanes is not None:  # a resume continues the same order (planning.lanes)
        meta[STREAM_LANES_KEY] = task.stream_lanes
    return meta
