"""A rank's batches from the Ray Datasets a data factory returned (``RayDataSplits``).

Ray Train splits the training dataset over the workers (``streaming_split(equal=True)``:
the same number of rows on every rank); each rank cuts its shard into micro-batches of
the plan's size and stops after the epoch's steps, so every rank takes the same steps.
Validation is not split: every rank reads the whole dataset in a preserved order and keeps
every ``world_size``-th batch, so each row counts exactly once. ``protocol.py`` says what
this promises and what not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from raytrain_app.errors import RunFailedError
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import DataSplits, RowsToBatch
from raytrain_app.worker.session import to_device

TRAIN, VAL = "train", "val"  # the names of the datasets given to Ray Train


@dataclass(frozen=True)
class RayDataPlan:
    """What a worker needs of ``RayDataSplits`` besides its shards (picklable: it travels
    in the ``WorkerTask``; the datasets themselves travel through Ray Train).

    Attributes:
        train_rows, val_rows: the datasets' row counts, as the driver counted them.
        steps_per_epoch: ``train_rows // global batch``, the same for every world size.
        to_batch: the factory's rows-to-batch function.
        info: the factory's ``info`` (for the model factory and checkpoints).
        sample: a few training rows (columns of NumPy arrays), the batches the memory probe
            and the driver's monitor check build: they index samples.
    """

    train_rows: int
    val_rows: int
    steps_per_epoch: int
    to_batch: RowsToBatch
    info: dict[str, Any] = field(default_factory=dict)
    sample: dict[str, np.ndarray] = field(default_factory=dict)

    def splits(self) -> DataSplits:
        """``DataSplits`` over the sample rows, batched by ``to_batch``: what the code that
        indexes samples (the memory probe, the driver's monitor check) gets instead of the
        Ray Datasets. ``info`` is the factory's."""
        rows = SampleRows(self.sample)
        return DataSplits(train=rows, val=rows, info=self.info, collate=RowsCollate(self.to_batch))

    def batches(
        self,
        plan: TrainingPlan,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        shard: Callable[[str], Any] | None = None,
    ) -> RayDatasetBatches:
        """This rank's batches; ``shard`` gives a dataset's iterator by name (Ray Train's
        ``get_dataset_shard`` unless a test passes its own)."""
        return RayDatasetBatches(self, plan, rank, world_size, device, shard)


class SampleRows(Dataset):
    """Rows of a ``dict`` of NumPy columns, one ``dict`` per index."""

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.columns = columns
        self._len = len(next(iter(columns.values()))) if columns else 0

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: column[index] for name, column in self.columns.items()}


@dataclass(frozen=True)
class RowsCollate:
    """A ``collate_fn`` for ``SampleRows``: stacks the rows into columns, as
    ``iter_batches`` gives them, and makes the batch with ``to_batch``."""

    to_batch: RowsToBatch

    def __call__(self, rows: list[dict[str, np.ndarray]]) -> Any:
        return self.to_batch({name: np.stack([row[name] for row in rows]) for name in rows[0]})


class RayDatasetBatches:
    """A rank's train and validation batches from its Ray Train dataset shards; the
    interface the loop reads (``worker.epoch_data.EpochData``)."""

    def __init__(
        self,
        ray_data: RayDataPlan,
        plan: TrainingPlan,
        rank: int,
        world_size: int,
        device: torch.device,
        shard: Callable[[str], Any] | None = None,
    ) -> None:
        if shard is None:
            import ray.train

            shard = ray.train.get_dataset_shard
        self.ray_data, self.plan, self.device = ray_data, plan, device
        self.rank, self.world_size = rank, world_size
        self.steps_per_epoch = ray_data.steps_per_epoch
        self.train_samples, self.val_samples = ray_data.train_rows, ray_data.val_rows
        self._train = shard(TRAIN)
        self._open: Any = None  # the epoch's iterator of the train shard, until closed
        self.val = ValidationBatches(shard(VAL), self, _val_batch_size(plan))

    def epoch_batches(self, epoch: int, skip_samples: int = 0) -> Iterator[Any]:
        """The epoch's micro-batches for this rank, after its first ``skip_samples`` rows
        (whole micro-batches; a mid-epoch resume's). Exactly ``steps_per_epoch x
        grad_accum_steps`` of them in all; the shard's rows beyond are left unread.

        ``epoch`` changes nothing: every call is a new pass of Ray's pipeline, which
        reshuffles per epoch itself where the dataset asks for it.
        """
        self._close()  # a pass left open (a stop mid-epoch) before Ray starts the next
        size = self.plan.per_worker_batch_size
        needed = self.steps_per_epoch * self.plan.grad_accum_steps
        skip = skip_samples // size
        # drop_last: every micro-batch has exactly `size` rows, so the step's global batch
        # is exact; no local shuffle buffer, which could yield short batches mid-stream.
        self._open = iter(
            self._train.iter_batches(batch_size=size, drop_last=True, batch_format="numpy")
        )
        return self._batches(self._open, skip, needed)

    def _batches(
        self, rows: Iterator[dict[str, np.ndarray]], skip: int, needed: int
    ) -> Iterator[Any]:
        size = self.plan.per_worker_batch_size
        for index in range(needed):
            columns = next(rows, None)
            if columns is None:
                self._close()
                raise RunFailedError(
                    f"rank {self.rank}'s shard of the Ray training dataset ran out after "
                    f"{index * size} rows, short of the {needed * size} that "
                    f"{self.steps_per_epoch} steps need: the dataset gave fewer rows than the "
                    f"driver counted ({self.train_samples}); make the pipeline deterministic"
                )
            if index == needed - 1:
                # The epoch's last batch: end Ray's pass now, so its split moves on without
                # waiting for rows nobody reads.
                self._close()
            if index >= skip:
                yield self._on_device(self.ray_data.to_batch(columns))

    def _on_device(self, batch: Any) -> Any:
        return batch if self.device.type == "cpu" else to_device(batch, self.device)

    def _close(self) -> None:
        opened, self._open = self._open, None
        close = getattr(opened, "close", None)
        if close is not None:
            close()

    def shut_down(self) -> None:
        self._close()


class ValidationBatches:
    """This rank's validation batches: batch ``j`` of the whole dataset, read in a
    preserved order, belongs to rank ``j % world_size``."""

    def __init__(self, dataset: Any, owner: RayDatasetBatches, batch_size: int) -> None:
        self.dataset, self.owner, self.batch_size = dataset, owner, batch_size

    def __len__(self) -> int:
        """How many batches this rank gets (``fsdp.equal_forwards`` asks)."""
        total = -(-self.owner.val_samples // self.batch_size)
        rank, world_size = self.owner.rank, self.owner.world_size
        return max(0, (total - rank + world_size - 1) // world_size)

    def __iter__(self) -> Iterator[Any]:
        owner = self.owner
        read = 0
        batches: Iterable[dict[str, np.ndarray]] = self.dataset.iter_batches(
            batch_size=self.batch_size, drop_last=False, batch_format="numpy"
        )
        for index, columns in enumerate(batches):
            read += _rows(columns)
            if index % owner.world_size == owner.rank:
                yield owner._on_device(owner.ray_data.to_batch(columns))
        if read != owner.val_samples:
            # Another count on another rank would count rows twice or never: refuse.
            raise RunFailedError(
                f"the Ray validation dataset gave {read} rows on rank {owner.rank}, but the "
                f"driver counted {owner.val_samples}; its pipeline must give the same rows "
                f"each time (no random_shuffle or sampling in val)"
            )


def _rows(columns: dict[str, np.ndarray]) -> int:
    return len(next(iter(columns.values()))) if columns else 0


def _val_batch_size(plan: TrainingPlan) -> int:
    """As the map-style loaders: a worker's share of the global batch, within the cap."""
    size = plan.per_worker_batch_size * plan.grad_accum_steps
    if plan.max_batch_per_worker is not None:
        size = min(size, plan.max_batch_per_worker)
    return size
