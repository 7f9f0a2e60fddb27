"""A worker's loaders: the same global batches for any world size, an epoch that resumes
part-way, and loader processes seeded per (epoch, rank) without touching the global RNG."""

from __future__ import annotations

from dataclasses import replace

import torch
from environments import make_env
from torch.utils.data import Dataset, get_worker_info

from raytrain_app.config import config_from_dict
from raytrain_app.planning.rules import make_plan
from raytrain_app.worker.loaders import WorkerLoaders, build_worker_loaders

GLOBAL_BATCH = 8


class Indices(Dataset):
    """Sample i is i; in a loader process, also that process's seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        return torch.tensor([i, info.seed % 2**31 if info else -1])


def _loaders(world_size: int, rank: int, n: int = 64, loader_workers: int = 0) -> WorkerLoaders:
    cfg = config_from_dict({"experiment": {"seed": 5}})
    plan = replace(
        make_plan(cfg, make_env()),
        world_size=world_size,
        per_worker_batch_size=GLOBAL_BATCH // world_size,
        grad_accum_steps=1,
        effective_batch_size=GLOBAL_BATCH,
        dataloader_workers=loader_workers,
        memory_probe=False,
    )
    return build_worker_loaders(
        Indices(n),
        Indices(n // 4),
        plan,
        cfg.dataloader,
        seed=5,
        rank=rank,
        world_size=world_size,
        prepare=lambda loader: loader,
    )


def _samples(batches) -> list[list[int]]:
    return [batch[:, 0].tolist() for batch in batches]


def test_a_global_step_sees_the_same_samples_for_one_or_two_workers():
    one = _samples(_loaders(1, 0).epoch_batches(epoch=2))
    rank0, rank1 = (_samples(_loaders(2, r).epoch_batches(epoch=2)) for r in (0, 1))
    assert len(one) == len(rank0) == len(rank1) == 64 // GLOBAL_BATCH
    for step, batch in enumerate(one):
        assert sorted(batch) == sorted(rank0[step] + rank1[step])
    # And a new epoch is a new permutation.
    assert _samples(_loaders(1, 0).epoch_batches(epoch=3)) != one


def test_a_resumed_epoch_yields_exactly_the_rest_and_only_once():
    loaders = _loaders(2, 1)
    full = _samples(loaders.epoch_batches(epoch=1))
    assert _samples(loaders.epoch_batches(epoch=1, skip_samples=3 * 4)) == full[3:]
    assert _samples(loaders.epoch_batches(epoch=1)) == full  # the skip was for one epoch


def test_validation_shards_count_every_sample_once():
    shards = [_loaders(2, r, n=66).val for r in (0, 1)]
    seen = sorted(i for shard in shards for batch in shard for i in batch[:, 0].tolist())
    assert seen == list(range(66 // 4))


def test_loader_processes_are_seeded_per_epoch_and_rank_not_from_the_global_rng():
    def process_seeds(rank: int, epoch: int) -> set[int]:
        loaders = _loaders(2, rank, loader_workers=1)
        try:
            return {int(seed) for batch in loaders.epoch_batches(epoch) for seed in batch[:, 1]}
        finally:
            loaders.shut_down()

    global_rng = torch.get_rng_state()
    seeds = {(rank, epoch): process_seeds(rank, epoch) for rank in (0, 1) for epoch in (0, 1)}
    assert torch.equal(torch.get_rng_state(), global_rng)  # a resume restores this stream
    assert len({frozenset(s) for s in seeds.values()}) == 4  # distinct per (rank, epoch)
    assert process_seeds(1, 1) == seeds[(1, 1)]  # and reproducible


def _validation_batch(train: dict, probed_fit: int | None = None) -> int:
    cfg = config_from_dict({"train": train, "scaling": {"num_workers": 1}})
    plan = make_plan(cfg, make_env())
    if probed_fit is not None:  # what the memory probe makes of the plan (memory_probe.py)
        plan = replace(
            plan,
            memory_probe=True,
            per_worker_batch_size=probed_fit,
            grad_accum_steps=plan.effective_batch_size // probed_fit,
            max_batch_per_worker=probed_fit,
        )
    loaders = build_worker_loaders(
        Indices(512),
        Indices(512),
        plan,
        cfg.dataloader,
        seed=5,
        rank=0,
        world_size=1,
        prepare=lambda loader: loader,
    )
    return loaders.raw[1].batch_size


def test_validation_batches_never_exceed_the_memory_cap():
    # 128 per worker under a cap of 8: 8 x 16 accumulation; validation takes 8 at a time.
    assert _validation_batch({"global_batch_size": 128, "max_batch_per_worker": 8}) == 8
    # 30 per worker under a cap of 8: micro-batches of 6 (x 5); validation may take 8.
    assert _validation_batch({"global_batch_size": 30, "max_batch_per_worker": 8}) == 8
    # What the memory probe measured caps it too.
    assert _validation_batch({"global_batch_size": 128, "max_batch_per_worker": "auto"}, 16) == 16
    # Without a cap, a worker's whole share of the global batch at once.
    assert _validation_batch({"global_batch_size": 128}) == 128
