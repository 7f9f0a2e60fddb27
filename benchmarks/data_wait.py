"""Data wait: the share of step time spent waiting for the next batch with the Parquet-backed
loader (raytrain's ``WindowDataset`` in a DataLoader exactly as ``loop.py`` builds it)
vs a mock loader that repeats one pre-built batch (Ray's ingest-benchmark method).
Goal: <= 5 %.

share = (step time with the real loader - step time with the mock) / step time with the
real loader; the time spent inside ``next(loader)`` is recorded alongside.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.common import interleave, median
from benchmarks.context import Context
from benchmarks.plain_loop import intra_op_threads
from benchmarks.workload import GLOBAL_BATCH, GRAD_CLIP, LR, SEED, WEIGHT_DECAY, Workload

logger = logging.getLogger(__name__)

GOAL_PERCENT = 5.0


def loop_py_loader(train_set: Any) -> DataLoader:
    """The training DataLoader of ``loop.WorkerLoop._loaders`` for 1 worker on CPU."""
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    return DataLoader(
        train_set,
        batch_size=GLOBAL_BATCH,
        sampler=sampler,
        drop_last=True,
        num_workers=0,
        pin_memory=False,
    )


class RepeatedBatch:
    """A loader that yields the same pre-built batch ``length`` times: zero data cost."""

    def __init__(self, batch: Any, length: int) -> None:
        self.batch, self.length = batch, length

    def __iter__(self) -> Iterator[Any]:
        return itertools.repeat(self.batch, self.length)

    def __len__(self) -> int:
        return self.length


class EpochTrainer:
    """One model trained epoch by epoch, from either loader, so the two alternate in one
    process on the same model (no drift between separate runs)."""

    def __init__(self, workload: Workload) -> None:
        splits, self.spec = workload.build()
        self.real = loop_py_loader(splits.train)
        self.mock = RepeatedBatch(next(iter(self.real)), len(self.real))
        self.model = self.spec.module
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY
        )
        self.epoch = 0

    def train_epoch(self, mock: bool) -> dict[str, float]:
        """One epoch; seconds per step and seconds per ``next()`` call."""
        loader: Any = self.mock if mock else self.real
        if not mock:
            self.real.sampler.set_epoch(self.epoch)
        self.epoch += 1
        self.model.train()
        with intra_op_threads(1):
            wait = 0.0
            start = time.perf_counter()
            batches = iter(loader)
            for _ in range(len(loader)):
                before = time.perf_counter()
                batch = next(batches)
                wait += time.perf_counter() - before
                out = self.spec.step(self.model, batch)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
        return {"s_per_step": elapsed / len(loader), "next_s_per_step": wait / len(loader)}


def run(ctx: Context) -> dict[str, Any]:
    workload = ctx.workload()
    with intra_op_threads(1):
        trainer = EpochTrainer(workload)
    # Epochs alternate real / mock on one model; the first pair is the warm-up.
    results = interleave(
        {
            "parquet_loader": lambda i: trainer.train_epoch(mock=False),
            "repeated_batch": lambda i: trainer.train_epoch(mock=True),
        },
        ctx.settings.repeats,
        warmup_rounds=1,
    )
    real = median([r["s_per_step"] for r in results["parquet_loader"]])
    mock = median([r["s_per_step"] for r in results["repeated_batch"]])
    next_time = median([r["next_s_per_step"] for r in results["parquet_loader"]])
    share = 100.0 * (real - mock) / real
    return {
        "what": (
            f"share of step time waiting for the batch: WindowDataset over Parquet, "
            f"DistributedSampler(num_replicas=1), batch {GLOBAL_BATCH}, drop_last, "
            f"num_workers 0, 1 intra-op thread; real and mock epochs alternate on one model"
        ),
        "figure": round(share, 2),
        "figure_unit": "%",
        "ratio": round(real / mock, 4),
        "ratio_is": "step time with the Parquet loader / with a repeated batch",
        "secondary": f"next() itself {100.0 * next_time / real:.1f} % of the step",
        "goal": f"<= {GOAL_PERCENT} %",
        "goal_met": share <= GOAL_PERCENT,
        "median_s_per_step": {"parquet_loader": round(real, 6), "repeated_batch": round(mock, 6)},
        "next_share_percent": round(100.0 * next_time / real, 2),
        "raw": results,
    }
