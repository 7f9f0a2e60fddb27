"""What accompanies the DDP model: gradient-compression hooks, the EMA of the weights, and
rank 0's buffers for every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def register_comm_hook(
    model: nn.Module, kind: str, powersgd_rank: int, start_powersgd_iter: int
) -> None:
    """Compress DDP's gradient all-reduce (it runs once per optimizer step: the
    accumulation steps before it run under ``no_sync``)."""
    if kind == "none" or not isinstance(model, nn.parallel.DistributedDataParallel):
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=start_powersgd_iter,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        model.register_comm_hook(None, hook[kind])


def make_ema(module: nn.Module, decay: float | None) -> AveragedModel | None:
    """An EMA of the bare module's weights and buffers; identical on every rank, since
    every rank applies the same update to the same (all-reduced) weights."""
    if decay is None:
        return None
    return AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def broadcast_buffers(module: nn.Module, world_size: int) -> None:
    """Rank 0's floating-point buffers to every rank, in one collective."""
    if world_size == 1 or not dist.is_initialized():
        return
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1) for b in buffers])
    dist.broadcast(flat, src=0)
    for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
        buffer.copy_(value.view_as(buffer))
