"""One optimizer step's math: the accumulation window's forward and backward passes under
the plan's precision, each micro-batch weighted by its items (``item_weights.py``), the
ranks' agreement on the step, then the update or the skip.

Nothing here logs, reports or checkpoints; ``loop.py`` does that around each step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from raytrain_app.config import TrainConfig
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import ModelSpec
from raytrain_app.worker.global_metrics import EpochProgress
from raytrain_app.worker.item_weights import StepItems, backward_loss, rescale_gradients
from raytrain_app.worker.model_companions import broadcast_buffers
from raytrain_app.worker.step_agreement import AgreedFlags, StepAgreement
from raytrain_app.worker.throughput import Throughput


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context of the plan's precision (none for fp32)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class StepOutcome:
    """What one step's micro-batches returned, and what every rank agreed on after it."""

    # (mean loss and metrics, items: StepOutput.num_samples) of each micro-batch
    micro_results: list[tuple[dict[str, torch.Tensor], int | torch.Tensor]]
    last_loss: torch.Tensor  # the last micro-batch's mean loss (for step-level tracking)
    metric_names: list[str]
    # Whether some rank's loss was NaN or infinite (every rank skips the step, or stops),
    # and whether some rank was asked to stop (every rank stops after this step).
    flags: AgreedFlags
    micro_counts: list[Mapping[str, torch.Tensor]] = field(default_factory=list)

    def losses(self) -> list[float]:
        return [float(values["loss"].detach()) for values, _ in self.micro_results]

    def add_to(self, progress: EpochProgress) -> None:
        for values, num_samples in self.micro_results:
            progress.averages.add(values, num_samples)
        for counts in self.micro_counts:
            progress.counts.add(counts)


class OptimizerStep:
    """The model, its optimizer and companions, and the math of one step over them."""

    def __init__(
        self,
        *,
        model: nn.Module,
        module: nn.Module,
        spec: ModelSpec,
        plan: TrainingPlan,
        train: TrainConfig,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        ema: AveragedModel | None,
        agreement: StepAgreement,
        device: torch.device,
        world_size: int,
    ) -> None:
        self.model, self.module, self.spec = model, module, spec
        self.plan, self.train = plan, train
        self.optimizer, self.scheduler, self.scaler, self.ema = optimizer, scheduler, scaler, ema
        self.agreement = agreement
        self.device, self.world_size = device, world_size
        self.throughput = Throughput(module, plan, device)  # FLOPs per sample, the peak
        # The step's items summed over every rank (on the device), by which apply() divides.
        self._global_items: torch.Tensor | None = None

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.plan.precision, self.device)

    def _sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Gradients are all-reduced only on the last micro-step of an accumulation window.
        ddp = _compiled_inner(self.model)
        if not last_micro_step and isinstance(ddp, nn.parallel.DistributedDataParallel):
            return ddp.no_sync()
        return contextlib.nullcontext()

    def forward_backward(self, batches: Iterator[Any], stop_requested: bool) -> StepOutcome:
        """Run the accumulation window's micro-batches; the ranks agree on the step's flags
        and sum its items in the last backward's gradient all-reduce."""
        accum = self.plan.grad_accum_steps
        items_per_rank = self.plan.per_worker_batch_size * accum  # item_weights.py's c
        micro_results: list[tuple[dict[str, torch.Tensor], int | torch.Tensor]] = []
        micro_counts: list[Mapping[str, torch.Tensor]] = []
        items = StepItems()
        for micro in range(accum):
            last = micro == accum - 1
            # The run's first micro-batch is counted (worker.flop_count), uncompiled.
            counted = self.throughput.flops.pending
            model = _compiled_inner(self.model) if counted else self.model
            counting = self.throughput.flops.counting() if counted else contextlib.nullcontext()
            with self._sync_context(last), counting:
                with self.autocast():
                    out = self.spec.step(model, next(batches))
                micro_results.append(({"loss": out.mean_loss, **out.metrics}, out.num_samples))
                micro_counts.append(out.counts)
                items.add(out.num_samples)
                if last:  # the flags and items travel with this backward's all-reduce
                    flags = _step_flags(micro_results, stop_requested)
                    self.agreement.send(flags, items.total(flags))
                self.scaler.scale(backward_loss(out, items_per_rank)).backward()
        agreed = self.agreement.receive_flags()
        self._global_items = agreed.items
        last_loss = micro_results[-1][0]["loss"]
        return StepOutcome(micro_results, last_loss, list(out.metrics), agreed, micro_counts)

    def apply(self, step: int) -> None:
        """Clip, update the weights and the schedule; then the EMA, as of optimizer ``step``
        (the step just taken, counted from 1)."""
        # The mean over every item of the global batch (item_weights.py), before clipping.
        assert self._global_items is not None, "apply() follows forward_backward()"
        rescale_gradients(
            self.model.parameters(), self.plan.effective_batch_size, self._global_items
        )
        if self.train.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train.grad_clip)
        scale = _scale_on_device(self.scaler)
        self.scaler.step(self.optimizer)  # skipped if a gradient overflowed (fp16)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None and step > self.plan.ema_start_step:
            # Unchanged weights must not pull the average: the update backs the scale off
            # exactly when the scaler skipped the step. Read only here (fp16 with an EMA).
            if scale is not None and bool(_scale_on_device(self.scaler) < scale):
                return
            # Buffers (BatchNorm statistics) are per rank until DDP's next forward: take
            # rank 0's, so the averaged buffers stay identical on every rank.
            broadcast_buffers(self.module, self.world_size)
            self.ema.update_parameters(self.module)  # the first update copies the weights

    def skip(self) -> None:
        """Drop the step's gradients; the schedule follows the data, so it still advances."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]


def _scale_on_device(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """A copy of the scaler's scale where it lives, without a host read; None when the
    scaler is off (fp32, bf16) or has not scaled yet."""
    current = scaler._scale if scaler.is_enabled() else None  # torch keeps it private
    return None if current is None else current.clone()


def _compiled_inner(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (the DDP model), or ``model`` itself.

    DDP's forward runs eagerly under compile and reads ``no_sync``'s flag on every call, so
    the wrapper's ``no_sync`` holds for the compiled model too.
    """
    return getattr(model, "_orig_mod", model)


def _step_flags(micro_results: list, stop_requested: bool) -> torch.Tensor:
    """This rank's view of the step: [a loss was non-finite, the driver asked to stop].

    Every rank then skips, stops or checkpoints at the same step (``StepAgreement``).
    """
    losses = torch.stack([values["loss"].detach().float() for values, _ in micro_results])
    stop = losses.new_full((), float(stop_requested))  # a fill: no copy from the host
    return torch.stack([(~torch.isfinite(losses).all()).float(), stop])
