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
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.errors import RunFailedError
from raytrain_app.planning.batch import plan_batch
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import CollateFn, ModelSpec, collate
from raytrain_app.worker.rank_zero import rank_zero_info
from raytrain_app.worker.session import to_device

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
    """The largest micro-batch (at most ``upper``) whose forward and backward fit.

    Runs no collective (each rank probes alone; ``fit_plan_to_memory`` agrees afterwards)
    and leaves ``module`` as it found it: its mode, every buffer (BatchNorm's running
    statistics, which the probe's train-mode forwards update) and its parameters' grads.
    """
    was_training = module.training
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    grads = [(p, p.grad) for p in module.parameters()]
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
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    for param, grad in grads:
        param.grad = grad
    return fits


def fit_plan_to_memory(
    plan: TrainingPlan,
    spec: ModelSpec,
    module: nn.Module,
    train_set: Any,
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
    world_size: int,
    collate: CollateFn = collate,
) -> TrainingPlan:
    """``plan`` with the largest micro-batch that fits on every rank (the smallest over
    all ranks, agreed in one all-reduce after each rank probed alone) and the global batch
    kept with accumulation. Gradient checkpointing is
    turned on first when it is ``auto``, the batch does not fit, and the model supports it.

    Runs on every rank before SyncBatchNorm and DDP touch the bare ``module``; the probe's
    batches are ``train_set``'s first samples, batched by the workload's ``collate``.
    """
    module.to(device)

    def probe() -> int:
        fits = probe_micro_batch(
            spec,
            module,
            train_set,
            collate,
            lambda batch: to_device(batch, device),
            plan.per_worker_batch_size,
            autocast,
            device,
        )
        fits_everywhere = torch.tensor(float(fits), device=device)
        if world_size > 1 and dist.is_initialized():
            dist.all_reduce(fits_everywhere, op=dist.ReduceOp.MIN)
        return int(fits_everywhere.item())

    fits = probe()
    checkpointing = plan.gradient_checkpointing
    hook = getattr(module, "gradient_checkpointing_enable", None)
    if fits < plan.per_worker_batch_size and plan.gradient_checkpointing_auto and hook:
        hook()
        checkpointing = True
        fits = probe()
    split = plan_batch(plan.effective_batch_size, plan.world_size, fits)
    rank_zero_info(
        logger,
        "memory probe: micro-batch %d fits%s; %d x %d accumulation keeps the global batch %d",
        fits,
        " with gradient checkpointing" if checkpointing else "",
        split.micro_batch,
        split.accum_steps,
        split.global_batch,
    )
    return replace(
        plan,
        per_worker_batch_size=split.micro_batch,
        grad_accum_steps=split.accum_steps,
        gradient_checkpointing=checkpointing,
        max_batch_per_worker=fits,
    )
