"""SyncBatchNorm for every device: torch's own on GPUs, an all-reduce version on CPUs.

``torch.nn.SyncBatchNorm`` does not run on CPUs: its forward raises "SyncBatchNorm
expected input tensor to be on GPU", its statistics kernels (``torch.batch_norm_stats``)
exist only for CUDA, and DDP refuses to wrap a CPU module holding one ("SyncBatchNorm
layers only work with GPU modules"). CPU training over gloo therefore gets
``GlooSyncBatchNorm``: the same batch statistics over every worker's samples, from one
all-reduce of every rank's per-channel mean, variance and count, with gradients that flow
back through the reduction as torch's do.

Conversion happens from the outside, before DDP wraps the model; the converted layers keep
BatchNorm's parameter and buffer names, so checkpoints load into the plain model.

Under ``torch.compile`` the synchronised forward runs eagerly, one graph break per layer,
and the rest of the model compiles. Dynamo cannot trace either kind in torch 2.13: torch's
drops empty ranks' statistics with a boolean mask (``count_all[mask]`` in
``torch/nn/modules/_functions.py``, an output shape that depends on the data) and ours
reads the global sample count as a Python number. Left to itself, dynamo traces into the
autograd function on every compile, gives up inside it and splits the graph several times
per layer (``fullgraph=True`` fails outright); marked, the layer is skipped cleanly.
Evaluation and a single worker take plain BatchNorm's path, which compiles.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def has_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` contains a BatchNorm layer (which SyncBatchNorm would replace)."""
    return any(isinstance(m, _BatchNorm) for m in module.modules())


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by one that syncs statistics across workers.

    Args:
        module: the plain model, before DDP wrapping.
        device: the training device; CUDA gets ``torch.nn.SyncBatchNorm``, any other
            device ``GlooSyncBatchNorm``.

    Returns:
        ``module`` itself with its layers replaced (a new module if ``module`` is itself a
        BatchNorm layer).
    """
    return _convert(module, CudaSyncBatchNorm if device.type == "cuda" else GlooSyncBatchNorm)


def _convert(module: nn.Module, layer: type[_BatchNorm]) -> nn.Module:
    """``nn.SyncBatchNorm.convert_sync_batchnorm`` with ``layer`` for the new layers."""
    if isinstance(module, _BatchNorm) and not isinstance(
        module, nn.SyncBatchNorm | GlooSyncBatchNorm
    ):
        converted = layer(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, _convert(child, layer))
    return module


def _synchronised(layer: CudaSyncBatchNorm | GlooSyncBatchNorm, input: torch.Tensor):
    return layer.synchronised_forward(input)


# ``_synchronised`` marked for torch.compile to run eagerly, by the first synchronised layer
# built: marking imports dynamo (2.5 s), which DDP imports anyway but importing this module
# must not (the worker loop imports it for every run). A layer unpickled without its
# __init__ before any was built runs unmarked: correct, with dynamo's own graph breaks.
_outside_compile: Callable[..., torch.Tensor] | None = None


def _mark_outside_compile() -> None:
    global _outside_compile
    if _outside_compile is None:
        _outside_compile = torch.compiler.disable(
            _synchronised, reason="SyncBatchNorm's statistics gather is not traceable"
        )


def _world_size(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group or dist.group.WORLD)


def _global_moments(
    mean: torch.Tensor, var: torch.Tensor, count: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean, biased variance and sample count over every rank's batch.

    One all-reduce of a ``[world, 2C + 1]`` table in which each rank fills its own row (an
    all-gather that gloo supports), combined in float64 with Chan's parallel formula: every
    rank computes bit-identical results from identical inputs.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(world, 2 * mean.numel() + 1, dtype=torch.float64, device=mean.device)
    table[rank] = torch.cat([mean.double(), var.double(), table.new_full((1,), count)])
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    means, variances, counts = table[:, : mean.numel()], table[:, mean.numel() : -1], table[:, -1:]
    total = counts.sum()
    global_mean = (counts * means).sum(dim=0) / total
    global_var = (counts * (variances + (means - global_mean) ** 2)).sum(dim=0) / total
    return global_mean, global_var, float(total)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with statistics over all ranks, on CPU kernels.

    The same algorithm as torch's CUDA SyncBatchNorm: local statistics, gathered; a fused
    normalisation; in the backward, the per-channel sums of ``dy`` and ``dy * x_hat``
    all-reduced so that every rank's input gradient is that of the total loss. Parameter
    gradients stay local (DDP averages them).
    """

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        eps: float,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        channels = input.shape[1]
        # Local statistics from BatchNorm's own fused CPU kernel (torch.var_mean over
        # [N, H, W] is several times slower); its normalised output is discarded.
        _, mean, invstd = torch.native_batch_norm(input, None, None, None, None, True, 0.0, eps)
        var = (invstd.double() ** -2 - eps).clamp_min(0)
        global_mean, global_var, total = _global_moments(
            mean, var, input.numel() // channels, group
        )
        if running_mean is not None and running_var is not None:
            unbiased = global_var * (total / max(total - 1, 1))
            running_mean.lerp_(global_mean.to(running_mean), momentum)
            running_var.lerp_(unbiased.to(running_var), momentum)
        mean, var = global_mean.to(input.dtype), global_var.to(input.dtype)
        output = F.batch_norm(input, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(input, weight, mean, torch.rsqrt(var + eps))
        ctx.total, ctx.eps, ctx.group = total, eps, group
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        scale = weight if weight is not None else torch.ones_like(mean)
        # Local sums: grad_bias = sum(dy), grad_weight = sum(dy * x_hat), fused.
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_output, input, scale, None, None, mean, invstd, True, ctx.eps, [False, True, True]
        )
        sums = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.group)
        mean_dy, mean_dy_xhat = (sums / ctx.total).chunk(2)
        # dx = a * (dy - mean_dy - x_hat * mean_dy_xhat) = a * dy + b * (x - mean) + c:
        # the last two terms in one fused pass (BatchNorm's eval kernel, unit variance).
        a = scale * invstd
        b, c = -a * invstd * mean_dy_xhat, -a * mean_dy
        grad_input = F.batch_norm(input, mean, torch.ones_like(mean), b, c, False, 0.0, 0.0)
        grad_input.addcmul_(grad_output, a.view([1, -1] + [1] * (input.dim() - 2)))
        return (
            grad_input,
            sum_dy_xhat if ctx.needs_input_grad[1] else None,
            sum_dy if ctx.needs_input_grad[2] else None,
            None,
            None,
            None,
            None,
            None,
        )


class GlooSyncBatchNorm(_BatchNorm):
    """BatchNorm over the samples of all workers, for any input rank and any device.

    Same parameters, buffers and state-dict keys as BatchNorm. Evaluation and a single
    worker take plain BatchNorm's path. It is deliberately not a ``torch.nn.SyncBatchNorm``
    subclass: DDP refuses those on CPU modules.
    """

    def __init__(self, *args, process_group: dist.ProcessGroup | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group
        _mark_outside_compile()

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and _world_size(self.process_group) > 1):
            return super().forward(input)
        return (_outside_compile or _synchronised)(self, input)

    def synchronised_forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = self._momentum()
        compute = torch.promote_types(input.dtype, torch.float32)
        # Statistics and normalisation in fp32 at least, also under bf16 autocast.
        with torch.autocast(input.device.type, enabled=False):
            output = _SyncBatchNormFunction.apply(
                input.to(compute),
                None if self.weight is None else self.weight.to(compute),
                None if self.bias is None else self.bias.to(compute),
                self.running_mean if self.track_running_stats else None,
                self.running_var if self.track_running_stats else None,
                momentum,
                self.eps,
                self.process_group,
            )
        return output.to(input.dtype)

    def _momentum(self) -> float:
        """The running-average factor of this step, as ``_BatchNorm.forward`` computes it."""
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum


class CudaSyncBatchNorm(nn.SyncBatchNorm):
    """torch's SyncBatchNorm (CUDA kernels, NCCL), with its synchronised forward outside
    ``torch.compile``'s graphs (the module docstring says why)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _mark_outside_compile()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and _world_size(self.process_group) > 1):
            return super().forward(input)
        return (_outside_compile or _synchronised)(self, input)

    def synchronised_forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input)
