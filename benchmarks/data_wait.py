"""Data wait: the share of step time spent waiting for the next batch with the Parquet-backed
loader (raytrain's ``WindowDataset`` in the loaders ``build_worker_loaders`` makes for
``loop.py``)
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import interleave, median
from benchmarks.context import Context
from benchmarks.plain_loop import intra_op_threads
from benchmarks.workload import (
    GLOBAL_BATCH,
    GRAD_CLIP,
    LR,
    SEED,
    WEIGHT_DECAY,
    Workload,
    train_config,
)
from raytrain_app.config import config_from_dict
from raytrain_app.planning.environment import detect_environment
from raytrain_app.planning.rules import make_plan
from raytrain_app.protocol import DataSplits
from raytrain_app.worker.loaders import WorkerLoaders, build_worker_loaders

logger = logging.getLogger(__name__)

GOAL_PERCENT = 5.0


def worker_loaders(splits: DataSplits) -> WorkerLoaders:
    """The loaders a raytrain worker trains with (``build_worker_loaders``), for 1 worker on
    CPU and without loader processes: the data path itself, in this process."""
    cfg = config_from_dict(train_config("bench", Path("."), workers=1, epochs=1, data={}))
    plan = replace(make_plan(cfg, detect_environment()), dataloader_workers=0)
    return build_worker_loaders(
        splits.train,
        splits.val,
        plan,
        cfg.dataloader,
        seed=SEED,
        rank=0,
        world_size=1,
        prepare=lambda loader: loader,
    )


class RepeatedBatch:
    """A loader that yields the same pre-built batch ``length`` times: zero data cost."""

    def __init__(self, batch: Any, length: int) -> None:
        self.batch, self.length = batch, length

    def __iter__(self) -> Iterator[Any]:
        return itertools.repeat(self.batch, self.length)

    def __len__(self) -> int:
        return self.length


class AlternatingTrainer:
    """One model trained step by step, alternating a batch from the real loader and the
    repeated batch, so both see the same machine at the same moment (no drift between
    separate runs on a shared machine)."""

    def __init__(self, workload: Workload) -> None:
        splits, self.spec = workload.build()
        self.loaders = worker_loaders(splits)
        self.loader = self.loaders.train
        self.mock_batch = next(iter(self.loader))
        self.model = self.spec.module
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY
        )
        self.epoch = 0
        self.batches: Iterator[Any] = iter(())

    def _next_real(self) -> Any:
        try:
            return next(self.batches)
        except StopIteration:
            self.batches = self.loaders.epoch_batches(self.epoch)
            self.epoch += 1
            return next(self.batches)

    def _step(self, batch: Any) -> None:
        out = self.spec.step(self.model, batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps: int) -> dict[str, float]:
        """``steps`` real and ``steps`` repeated-batch steps, alternating; mean times."""
        self.model.train()
        real = mock = wait = 0.0
        with intra_op_threads(1):
            for _ in range(steps):
                start = time.perf_counter()
                batch = self._next_real()
                fetched = time.perf_counter()
                self._step(batch)
                middle = time.perf_counter()
                self._step(self.mock_batch)
                end = time.perf_counter()
                real += middle - start
                wait += fetched - start
                mock += end - middle
        return {
            "real_s_per_step": real / steps,
            "mock_s_per_step": mock / steps,
            "next_s_per_step": wait / steps,
            "share_percent": 100.0 * (real - mock) / real,
        }


def run(ctx: Context) -> dict[str, Any]:
    workload = ctx.workload()
    with intra_op_threads(1):
        trainer = AlternatingTrainer(workload)
    steps = len(trainer.loader)  # a round: one epoch's worth of each kind of step
    results = interleave(
        {"alternating": lambda i: trainer.run(steps)}, ctx.settings.repeats, warmup_rounds=1
    )["alternating"]
    share = median([r["share_percent"] for r in results])
    real = median([r["real_s_per_step"] for r in results])
    mock = median([r["mock_s_per_step"] for r in results])
    next_share = median([100.0 * r["next_s_per_step"] / r["real_s_per_step"] for r in results])
    return {
        "what": (
            f"share of step time waiting for the batch: WindowDataset over Parquet, "
            f"raytrain's worker loaders for 1 worker, batch {GLOBAL_BATCH}, drop_last, "
            f"num_workers 0, 1 intra-op thread; real-loader and repeated-batch steps "
            f"alternate on one model, {steps} of each per round"
        ),
        "figure": round(share, 2),
        "figure_unit": "%",
        "ratio": round(real / mock, 4),
        "ratio_is": "step time with the Parquet loader / with a repeated batch",
        "secondary": f"next() itself {next_share:.1f} % of the step",
        "goal": f"<= {GOAL_PERCENT} %",
        "goal_met": share <= GOAL_PERCENT,
        "median_s_per_step": {"parquet_loader": round(real, 6), "repeated_batch": round(mock, 6)},
        "next_share_percent": round(next_share, 2),
        "raw": results,
    }
