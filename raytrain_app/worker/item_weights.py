"""Item-weighted gradients: an optimizer step trains on the mean over every item of the
global batch, ``sum_i(n_i * loss_i) / sum_i(n_i)`` over every micro-batch ``i`` of every
rank, where ``n_i`` is ``StepOutput.num_samples`` (samples, real tokens, nodes).

A step's counts are known only after its forwards (the step function returns them), and
holding every micro-batch's graph until all are known would cost the memory accumulation
exists to save. The gradient is linear in the loss, so the weighting is split in two:

- each micro-batch backpropagates ``loss_i * n_i / c`` (``backward_loss``), with
  ``c = per_worker_batch_size * grad_accum_steps``, the same on every rank: ``W * c`` is
  the global batch ``G``. DDP's all-reduce (and FSDP's reduce-scatter) averages the W
  ranks, which leaves ``sum_ri n_ri * g_ri / G``;
- the ranks sum their items ``N`` in the step's agreement (``step_agreement.py``: in DDP's
  last gradient bucket, or in the one small all-reduce that carries the flags otherwise),
  and the gradients are multiplied by ``G / N`` on the device (``rescale_gradients``)
  before clipping, the scaler's unscale and the update: ``sum n * g / N``.

No collective is added and nothing is read back to the host: counts given as tensors stay
on the device. Where every micro-batch holds the planned number of samples (``n_i`` is the
micro-batch size), the backward sees ``loss / grad_accum_steps`` as before and ``G / N`` is
exactly 1: bit for bit what an unweighted mean trains. Where ``n_i`` counts tokens, the
backward's gradients are larger by the tokens per sample; under fp16 the GradScaler's
dynamic scale settles correspondingly lower in the first steps (bf16 and fp32 have the
range of fp32).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from raytrain_app.protocol import StepOutput


def backward_loss(out: StepOutput, items_per_rank: int) -> torch.Tensor:
    """What a micro-batch backpropagates: ``loss * n / items_per_rank`` for a mean over
    ``n`` items, ``loss / items_per_rank`` for a sum. ``items_per_rank`` is ``c`` above.

    Divided by ``items_per_rank / n``, which is exactly ``grad_accum_steps`` when ``n`` is
    the micro-batch size: the loss ``backward`` saw before gradients were item-weighted.
    """
    if out.loss_reduction == "sum":
        return out.loss / items_per_rank
    count = out.num_samples
    if isinstance(count, torch.Tensor):
        return out.loss / (items_per_rank / count.detach().reshape(()))
    return out.loss / (items_per_rank / count) if count else out.loss * 0.0


class StepItems:
    """One rank's items over a step's micro-batches: ints summed on the host, tensors on
    their device, never read back."""

    def __init__(self) -> None:
        self._ints = 0
        self._tensors: torch.Tensor | None = None

    def add(self, count: int | torch.Tensor) -> None:
        if isinstance(count, torch.Tensor):
            count = count.detach().reshape(())
            self._tensors = count if self._tensors is None else self._tensors + count
        else:
            self._ints += count

    def total(self, like: torch.Tensor) -> torch.Tensor:
        """The sum as a float64 scalar on ``like``'s device (a fill, not a host copy: a
        copy from the host would wait for the device's queued work)."""
        total = like.new_full((), float(self._ints), dtype=torch.float64)
        return total if self._tensors is None else total + self._tensors


@torch.no_grad()
def rescale_gradients(
    parameters: Iterable[torch.Tensor], global_batch: int, items: torch.Tensor
) -> None:
    """Multiply every gradient by ``global_batch / items`` (0 when no rank had an item),
    on the device; ``items`` is the step's count summed over every rank."""
    factor = torch.where(items > 0, global_batch / items, 0.0).float()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            by_device.setdefault(parameter.grad.device, []).append(parameter.grad)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, factor.to(device))
