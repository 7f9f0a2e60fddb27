"""What a worker reports to Ray after an epoch or between steps, and the checkpoint that
goes with it: every rank reports (Ray needs equal counts), rank 0 writes the checkpoint
with every rank's RNG and unfinished-epoch sums gathered into it (with FSDP every rank
writes and reports its shards besides)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from raytrain_app.checkpoint.data_identity import IDENTITY_KEY
from raytrain_app.checkpoint.ranking import SCORE_KEY, checkpoint_score
from raytrain_app.checkpoint.sharded import is_sharded
from raytrain_app.checkpoint.store import checkpoint_name
from raytrain_app.checkpoint.train_state import LoopState, Trainables, rng_state, save_resumable
from raytrain_app.config import TrainConfig
from raytrain_app.planning.lanes import STREAM_LANES_KEY
from raytrain_app.worker.global_metrics import EpochProgress, gather
from raytrain_app.worker.rank_zero import is_rank_zero
from raytrain_app.worker.session import WorkerSession, scratch_dir


class Reporter:
    """Reports rows to the session; checkpoints them when due."""

    def __init__(
        self, session: WorkerSession, train: TrainConfig, meta: dict[str, Any], world_size: int
    ) -> None:
        self.session, self.train, self.world_size = session, train, world_size
        self.meta = meta  # what every checkpoint's meta.json holds besides its progress

    def report(
        self,
        row: dict[str, float],
        due: bool,
        state: LoopState,
        trainables: Trainables,
        progress: EpochProgress,
    ) -> None:
        """Report ``row`` on this rank; with ``due``, rank 0 also writes a checkpoint."""
        per_rank = {"rng": rng_state(), "epoch": progress.to_dict()} if due else None
        ranks = gather(per_rank, self.world_size) if due else None
        name = checkpoint_name(state.epoch, state.step) if due else None
        # Ray ranks checkpoints by this score (train.monitor / train.mode); see ranking.py.
        reported = {**row, SCORE_KEY: checkpoint_score(row, self.train.monitor, self.train.mode)}
        # A sharded (FSDP) model is checkpointed by every rank, each reporting its part.
        every_rank = due and is_sharded(trainables.model)
        if not (every_rank or (due and is_rank_zero())):
            self.session.report(reported, None, name)
            return
        meta = {**self.meta, "epoch": state.epoch, "step": state.step, "metrics": row}
        with scratch_dir() as directory:
            save_resumable(directory, trainables, state, ranks, meta=meta)
            self.session.report(reported, directory, name, every_rank=every_rank)


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
