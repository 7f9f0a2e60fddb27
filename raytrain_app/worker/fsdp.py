"""``distributed.strategy: fsdp``: the model and its EMA sharded with FSDP2 (``fully_shard``),
block by block and then the root, over the process group Ray made.

Each block's parameters are gathered just before its forward and backward and freed after,
so a rank holds whole only the block it is computing; the optimizer state is sharded
with the parameters (DTensors), and ``clip_grad_norm_`` over DTensor gradients clips by the
whole model's norm. Gradients are reduce-scattered after every micro-batch of an
accumulation window: skipping that would hold every block's gradients whole until the last
micro-batch, the memory FSDP saves. Which modules are blocks:

- the module list a model returns from ``fsdp_blocks()``, if it defines that method;
- otherwise every item of an ``nn.ModuleList`` or ``nn.Sequential`` that holds parameters
  (the repeated layers of transformers and ResNets), outermost first: a block's own
  sub-layers are not split further;
- otherwise (no such container) the root's direct children that hold parameters.

The root is sharded last and owns what no block holds. Validation and the EMA use the
sharded model too (``equal_forwards``).

Under bf16 the parameters are all-gathered, and the forward and backward computed, in bf16
(FSDP2's ``MixedPrecisionPolicy``), while the shards the optimizer steps stay fp32 and
gradients are reduce-scattered in fp32: ``mixed_precision``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel

from raytrain_app.errors import RunFailedError
from raytrain_app.worker.model_companions import make_ema
from raytrain_app.worker.rank_zero import rank_zero_info

logger = logging.getLogger(__name__)


def fsdp_blocks(module: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one before the root (the rule in the module docstring)."""
    hook = getattr(module, "fsdp_blocks", None)
    if callable(hook):
        return list(hook())
    blocks = list(_container_items(module))
    if blocks:
        return blocks
    return [child for child in module.children() if _holds_parameters(child)]


def _container_items(module: nn.Module) -> Iterator[nn.Module]:
    """Items of every ModuleList / Sequential that hold parameters, outermost first."""
    container = isinstance(module, nn.ModuleList | nn.Sequential)
    for child in module.children():
        if container and _holds_parameters(child):
            yield child  # a block; its own sub-layers are not split further
        else:
            yield from _container_items(child)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


_LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the plan's ``precision``.

    Parameters are all-gathered in the low dtype, the traffic that halves: twice a step
    (before the forward and again before the backward) against one reduce-scatter. The
    reduce-scatter stays fp32: it sums every rank's gradient, which a bf16 sum (8 bits of
    mantissa) would round, and it lands in the fp32 shards the optimizer steps (as in
    torchtitan's default). fp32 gets the default policy: no casts.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = _LOW_PRECISION.get(precision)
    if low is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def shard(module: nn.Module, mesh: Any, precision: str) -> int:
    """Shard ``module`` in place over ``mesh`` (a ``DeviceMesh``): blocks, then the root; the
    number of blocks. ``precision``: the plan's (``mixed_precision``)."""
    # Imported here: FSDP brings DTensor, some 0.6 s of CPU that only an FSDP run should pay.
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(precision)
    blocks = fsdp_blocks(module)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return len(blocks)


def shard_model_and_ema(
    module: nn.Module,
    ema_decay: float | None,
    device: torch.device,
    precision: str | None = None,
) -> tuple[nn.Module, AveragedModel | None]:
    """The model sharded, and its EMA (or None) sharded alike, so that the EMA's update is
    shard by shard and validating with it is a sharded forward.

    One process without a process group has nothing to shard: the model stays plain.
    ``precision``: the plan's, for the all-gathers (``mixed_precision``); None: fp32.
    """
    ema = make_ema(module, ema_decay)  # copied before sharding, then sharded the same way
    if not dist.is_initialized():
        return module, ema
    from torch.distributed.device_mesh import init_device_mesh

    # Ray made the default process group; the mesh reuses it, on this worker's device.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = shard(module, mesh, precision or "fp32")
    if ema is not None:
        shard(ema.module, mesh, precision or "fp32")
    rank_zero_info(
        logger,
        "FSDP: %d block(s) and the root sharded over %d worker(s)",
        blocks,
        dist.get_world_size(),
    )
    return module, ema


def equal_forwards(batches: Any, sharded: bool, device: torch.device) -> Iterator[tuple[Any, bool]]:
    """``(batch, counts)`` for every batch of ``batches`` (``counts`` True); for a sharded
    model then this rank's first batch again (``counts`` False) until it has run as many
    forwards as the rank with the most batches: each forward of a sharded model gathers
    parameters from every rank, so a rank that stopped early would hang the others.

    Raises:
        RunFailedError: some ranks have batches and some none (too few samples to split).
    """
    if not (sharded and dist.is_initialized() and dist.get_world_size() > 1):
        yield from ((batch, True) for batch in batches)
        return
    count = len(batches)
    extremes = torch.tensor([count, -count], device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    most, fewest = int(extremes[0]), -int(extremes[1])
    if fewest == 0 < most:
        raise RunFailedError(
            f"some workers have no validation batch, and distributed.strategy=fsdp runs "
            f"every forward on all {dist.get_world_size()} workers; give the data at least "
            f"scaling.num_workers validation samples or use distributed.strategy=ddp"
        )
    first = None
    for batch in batches:
        first = batch if first is None else first
        yield batch, True
    for _ in range(most - count):
        yield first, False
