"""A rank's data for the loop, whatever the data factory returned.

Map-style datasets (``DataSplits``) go through DataLoaders with raytrain's sampler
(``loaders``); prepared streaming data (``StreamSplits``) streams from its files
(``stream_batches``). Both give the loop the same things: an epoch's micro-batches from
a step on, the validation batches, the steps per epoch, and the sample counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from torch.utils.data import Dataset

from raytrain_app.config import DataloaderConfig
from raytrain_app.data.stream_windows import StreamSplits
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import DataSplits
from raytrain_app.worker.loaders import build_worker_loaders
from raytrain_app.worker.stream_batches import StreamBatches


class EpochData(Protocol):
    """What the loop reads its batches from."""

    steps_per_epoch: int
    train_samples: int
    val_samples: int
    val: Iterable[Any]

    def epoch_batches(self, epoch: int, skip_samples: int = 0) -> Iterator[Any]: ...

    def shut_down(self) -> None: ...


def build_epoch_data(
    splits: DataSplits | StreamSplits,
    plan: TrainingPlan,
    options: DataloaderConfig,
    *,
    seed: int,
    rank: int,
    world_size: int,
    prepare: Callable[[Any], Any],
    stream_lanes: int | None = None,
) -> EpochData:
    """This rank's ``EpochData``; ``prepare`` is the session's ``prepare_loader``;
    ``stream_lanes``: streaming data's lane count, as the driver chose it."""
    if isinstance(splits, StreamSplits):
        return StreamBatches(
            splits.files(),
            plan,
            seed=seed,
            rank=rank,
            world_size=world_size,
            prepare=prepare,
            lanes=stream_lanes,
        )
    return build_worker_loaders(
        splits.train,
        splits.val,
        plan,
        options,
        seed=seed,
        rank=rank,
        world_size=world_size,
        prepare=prepare,
        collate=splits.batch_collate(),
    )


def probe_samples(splits: DataSplits | StreamSplits, plan: TrainingPlan) -> Dataset:
    """Training samples the memory probe may batch: a worker's whole share of a step at
    most (streaming data reads just that many)."""
    if isinstance(splits, StreamSplits):
        return splits.preview("train", plan.effective_batch_size)
    return splits.train
