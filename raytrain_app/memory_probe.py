"""Find the largest micro-batch that fits the GPU (``train.max_batch_per_worker: auto``).

The probe runs forward and backward of the real model on real samples, halving the
micro-batch on out-of-memory, while a reserve is held for what training adds later (the
optimizer's state and DDP's gradient buckets). The plan then keeps the global batch with
gradient accumulation, so the optimisation is the same whatever fits.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from raytrain_app.errors import RunFailedError
from raytrain_app.protocol import ModelSpec

logger = logging.getLogger(__name__)

# Bytes held back per parameter byte during the probe: AdamW's two moments, DDP's
# gradient buckets and some allocator slack.
_RESERVE_PER_PARAM_BYTE = 3.5


def largest_fitting(try_micro_batch: Callable[[int], None], upper: int) -> int:
    """The largest of ``upper, upper/2, ..., 1`` for which ``try_micro_batch`` runs
    without running out of device memory."""
    size = upper
    while size >= 1:
        try:
            try_micro_batch(size)
            return size
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            logger.debug("micro-batch %d does not fit", size)
            size //= 2
    raise RunFailedError(
        "not even a micro-batch of 1 sample fits in the GPU's memory; set "
        "optimizations.gradient_checkpointing=true, use precision bf16/fp16, or a smaller model"
    )


@contextlib.contextmanager
def _reserve(module: nn.Module, device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    held = torch.empty(int(param_bytes * _RESERVE_PER_PARAM_BYTE), dtype=torch.uint8, device=device)
    try:
        yield
    finally:
        del held
        torch.cuda.empty_cache()


def probe_micro_batch(
    spec: ModelSpec,
    module: nn.Module,
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    to_device: Callable[[Any], Any],
    upper: int,
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> int:
    """The largest micro-batch (at most ``upper``) whose forward and backward fit."""
    was_training = module.training
    module.train()

    def try_micro_batch(size: int) -> None:
        batch = to_device(collate([dataset[i % len(dataset)] for i in range(size)]))
        try:
            with autocast():
                loss = spec.step(module, batch).loss
            loss.backward()
        finally:
            module.zero_grad(set_to_none=True)

    # The probe's draws (dropout) must not shift the training's random streams.
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        _reserve(module, device),
    ):
        fits = largest_fitting(try_micro_batch, upper)
    module.train(was_training)
    return fits
