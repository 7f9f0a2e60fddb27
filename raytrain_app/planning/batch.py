"""The batch arithmetic of a plan: the global batch split over workers and accumulation,
steps per epoch, and the learning-rate rules. Pure functions; the workers use them too
(the memory probe re-splits, the scheduler follows ``lr_factor``)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from raytrain_app.errors import BadInputError

logger = logging.getLogger(__name__)


class PlanError(BadInputError):
    """The config cannot be run on these resources; one sentence naming the key to change."""


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is split: ``micro_batch * world_size * accum_steps == global``."""

    world_size: int
    micro_batch: int
    accum_steps: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size * self.accum_steps


def nearest_multiples(value: int, step: int) -> list[int]:
    """The multiples of ``step`` just below and above ``value`` (positive ones only)."""
    lower = (value // step) * step
    return [m for m in (lower, lower + step) if m > 0]


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` (>= 1) that is at most ``cap`` (>= 1).

    At most about ``sqrt(n)`` trial divisions, not ``cap``: divisors come in pairs
    ``(i, n // i)`` around ``sqrt(n)``, so a batch of 10**9 takes some 30 000 steps.
    """
    root = math.isqrt(n)
    if cap <= root:
        return next(d for d in range(cap, 0, -1) if n % d == 0)
    # The large partner n // i is at most cap exactly when i >= n / cap; the smallest
    # such i that divides n gives the largest large divisor.
    for i in range(-(-n // cap), root + 1):
        if n % i == 0:
            return n // i
    return next(d for d in range(root, 0, -1) if n % d == 0)


def plan_batch(global_batch: int, world_size: int, max_per_worker: int | None) -> BatchPlan:
    """Split ``global_batch`` over ``world_size`` workers and gradient-accumulation steps.

    Picks the largest micro-batch that divides each worker's share and fits under
    ``max_per_worker``, so accumulation is used only as much as the memory cap requires.
    """
    if global_batch % world_size:
        suggestions = " or ".join(str(m) for m in nearest_multiples(global_batch, world_size))
        raise PlanError(
            f"train.global_batch_size={global_batch} cannot be split evenly over {world_size} "
            f"workers; set train.global_batch_size to a multiple of {world_size} "
            f"(e.g. {suggestions}) or change scaling.num_workers"
        )
    per_worker = global_batch // world_size
    cap = per_worker if max_per_worker is None else min(per_worker, max_per_worker)
    micro = largest_divisor_at_most(per_worker, cap)
    plan = BatchPlan(world_size=world_size, micro_batch=micro, accum_steps=per_worker // micro)
    if max_per_worker is not None and micro * 2 <= max_per_worker and plan.accum_steps > 1:
        better = nearest_multiples(global_batch, world_size * max_per_worker)
        logger.warning(
            "train.global_batch_size=%d over %d workers only splits into micro-batches of %d "
            "under train.max_batch_per_worker=%d; a global batch of %s would use the full cap",
            global_batch,
            world_size,
            micro,
            max_per_worker,
            " or ".join(map(str, better)),
        )
    return plan


def scaled_lr(lr: float, rule: str, global_batch: int, base_batch: int | None) -> float:
    """Scale ``lr`` from the batch it was tuned for (``base_batch``) to ``global_batch``."""
    ratio = global_batch / (base_batch or global_batch)
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    return lr


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer ``step``: linear warmup, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Optimizer steps per epoch; the tail that cannot fill a global batch is dropped.

    Dropping (rather than padding) keeps every rank at the same step count and makes each
    optimizer step see exactly ``global_batch`` distinct samples for any world size.
    """
    if num_samples < global_batch:
        raise PlanError(
            f"the training set has {num_samples} samples, fewer than train.global_batch_size="
            f"{global_batch}; lower train.global_batch_size or use more data"
        )
    return num_samples // global_batch
