"""A worker's train and validation loaders.

One sampler for every world size (rank r takes every W-th index of the same seeded
permutation), loader processes seeded per (epoch, rank) from the loader's own generator,
and a position inside an epoch that a mid-epoch resume can skip to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from raytrain_app.config import DataloaderConfig
from raytrain_app.planning.batch import steps_per_epoch
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import CollateFn, collate
from raytrain_app.worker.sampler import ResumableDistributedSampler


@dataclass
class WorkerLoaders:
    """This rank's loaders; ``train`` and ``val`` are what the session prepared (device
    placement, Ray's sampler checks), ``raw`` the DataLoaders underneath."""

    train: Any
    val: Any
    sampler: ResumableDistributedSampler
    generator: torch.Generator
    raw: tuple[DataLoader, DataLoader]
    seed: int
    rank: int
    steps_per_epoch: int
    train_samples: int
    val_samples: int

    def epoch_batches(self, epoch: int, skip_samples: int = 0) -> Iterator[Any]:
        """The train batches of ``epoch`` for this rank, after its first ``skip_samples``
        samples (those a mid-epoch checkpoint had already trained on)."""
        self.sampler.set_epoch(epoch)  # Ray's prepare_data_loader never does this.
        set_dataset_epoch = getattr(self.sampler.dataset, "set_epoch", None)
        if set_dataset_epoch is not None:  # optional hook: per-epoch augmentation (protocol.py)
            set_dataset_epoch(epoch)
        self.generator.manual_seed(loader_seed(self.seed, epoch, self.rank))
        self.sampler.skip_next(skip_samples)
        return iter(self.train)

    def shut_down(self) -> None:
        """Persistent DataLoader processes otherwise linger until garbage collection, each
        then waiting seconds to be killed: a reused Tune actor or a test would wait too."""
        for loader in self.raw:
            iterator = loader._iterator
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()


def build_worker_loaders(
    train_set: Any,
    val_set: Any,
    plan: TrainingPlan,
    options: DataloaderConfig,
    *,
    seed: int,
    rank: int,
    world_size: int,
    prepare: Callable[[DataLoader], Any],
    collate: CollateFn = collate,
) -> WorkerLoaders:
    """The loaders of rank ``rank``; ``prepare`` is the session's ``prepare_loader``,
    ``collate`` the workload's (``DataSplits.batch_collate``)."""
    loader_kwargs: dict[str, Any] = {
        "num_workers": plan.dataloader_workers,
        "pin_memory": plan.pin_memory,
        # By default takes a dataset's batched __getitems__ result as is (protocol.py).
        "collate_fn": collate,
    }
    if plan.dataloader_workers > 0:
        loader_kwargs["persistent_workers"] = options.persistent_workers
        loader_kwargs["prefetch_factor"] = options.prefetch_factor
    # One sampler for every world size: a global step sees the same samples for 1 or 64
    # workers.
    sampler = ResumableDistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    # The loader's own generator seeds its worker processes per (epoch, rank), so
    # creating an iterator never draws from the global RNG a resume restores.
    generator = torch.Generator()
    train = DataLoader(
        train_set,
        batch_size=plan.per_worker_batch_size,
        sampler=sampler,
        drop_last=True,
        generator=generator,
        **loader_kwargs,
    )
    # Validation shards without padding so that every sample counts exactly once.
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    # Without gradients a worker's whole share of the global batch at once, but never more
    # than the memory cap (train.max_batch_per_worker, or what the memory probe measured):
    # a forward of the accumulated batch would not fit where its micro-batches barely do.
    val_batch = plan.per_worker_batch_size * plan.grad_accum_steps
    if plan.max_batch_per_worker is not None:
        val_batch = min(val_batch, plan.max_batch_per_worker)
    val = DataLoader(val_shard, batch_size=val_batch, **loader_kwargs)
    return WorkerLoaders(
        train=prepare(train),
        val=prepare(val),
        sampler=sampler,
        generator=generator,
        raw=(train, val),
        seed=seed,
        rank=rank,
        steps_per_epoch=steps_per_epoch(len(train_set), plan.effective_batch_size),
        train_samples=len(train_set),
        val_samples=len(val_set),
    )


def loader_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of a rank's loader generator for one epoch: reproducible, distinct per rank."""
    return (seed * 1_000_003 + epoch * 10_007 + rank) % 2**63
