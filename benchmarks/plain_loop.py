"""The plain-PyTorch baseline: the textbook loop a user would write for the same workload.

Same model and data (raytrain's factories), same micro-batch, AdamW, grad clip 1.0 and a
LambdaLR stepped per optimizer step, fp32, one intra-op thread as in a 1-CPU Ray worker.
The loss is the workload's own ``step`` function (the model's computation, not the
framework's), so the comparison isolates what raytrain adds around it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.workload import GLOBAL_BATCH, GRAD_CLIP, LR, SEED, WEIGHT_DECAY, Workload, lr_lambda


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run with ``count`` intra-op threads, restoring the process's setting afterwards."""
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def train_epochs(
    workload: Workload,
    epochs: int,
    *,
    batch_size: int = GLOBAL_BATCH,
    loader: Iterable[Any] | None = None,
    steps: int | None = None,
) -> list[float]:
    """Train ``epochs`` epochs on one thread; return each epoch's training time in seconds.

    Args:
        loader: batches to train on instead of a shuffled DataLoader over the train split.
        steps: optimizer steps per epoch (default: the loader's length).
    """
    with intra_op_threads(1):
        splits, spec = workload.build()
        model = spec.module
        if loader is None:
            generator = torch.Generator().manual_seed(SEED)
            loader = DataLoader(
                splits.train,
                batch_size=batch_size,
                shuffle=True,
                drop_last=True,
                generator=generator,
            )
        steps = steps or len(loader)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(steps * epochs))
        times = []
        for _ in range(epochs):
            model.train()
            start = time.perf_counter()
            batches = iter(loader)
            for _ in range(steps):
                out = spec.step(model, next(batches))
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            times.append(time.perf_counter() - start)
        return times
