"""A resumed run's schedule moved to another peak lr: every learning rate it holds, scaled.

A Tune PBT trial continues a better trial's checkpoint with its lr mutated. The saved
schedule resumes where it was, so the new lr has to reach every place where a torch
scheduler keeps a learning rate: the optimizer's ``lr`` (the recursive schedulers, StepLR,
ExponentialLR, CosineAnnealingLR, compute the next lr from it), ``initial_lr``,
OneCycleLR's ``max_lr``/``min_lr``, each scheduler's ``base_lrs``, ``eta_min`` and
CyclicLR's ``max_lrs``, and the schedulers a SequentialLR or ChainedScheduler (the warmup
ramp around ``train.schedule``) holds. Scaled by one ratio, the whole lr curve from the
resumed step on is the saved run's times ``new / old``: for a schedule whose lrs follow
``train.lr`` (every built-in one, ``schedule.target`` classes without lrs of their own)
exactly what a fresh run at the new lr uses; lrs given in ``schedule.params``
(OneCycleLR's ``max_lr``, ``eta_min``) move by the same ratio.
"""

from __future__ import annotations

from typing import Any

import torch

Scheduler = torch.optim.lr_scheduler.LRScheduler

# Learning rates (absolute values, not factors) in torch.optim.lr_scheduler's classes.
_GROUP_LRS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_LRS = ("base_lrs", "_last_lr", "eta_min", "max_lrs", "min_lrs")


def rescale_lrs(scheduler: Scheduler, optimizer: torch.optim.Optimizer, ratio: float) -> None:
    """Multiply every learning rate ``optimizer`` and ``scheduler`` (with the schedulers
    inside it) hold by ``ratio``."""
    if ratio == 1.0:  # a plain resume stays bit-for-bit
        return
    for group in optimizer.param_groups:
        for key in _GROUP_LRS:
            if key in group:
                group[key] = _scaled(group[key], ratio)
    for each in _with_inner(scheduler):
        for name in _SCHEDULER_LRS:
            if name in vars(each):
                # New values, never in place: a SequentialLR's _last_lr is its inner
                # scheduler's list (one object, after a checkpoint's round trip too).
                setattr(each, name, _scaled(getattr(each, name), ratio))


def _with_inner(scheduler: Scheduler) -> list[Scheduler]:
    """``scheduler`` and every scheduler it holds, at any depth, each once."""
    found: dict[int, Scheduler] = {}
    pending = [scheduler]
    while pending:
        each = pending.pop()
        if id(each) in found:
            continue
        found[id(each)] = each
        for value in vars(each).values():
            inner = value if isinstance(value, list | tuple) else [value]
            pending += [s for s in inner if isinstance(s, Scheduler)]
    return list(found.values())


def _scaled(value: Any, ratio: float) -> Any:
    """``value`` (a number, a tensor, or a list of them) times ``ratio``; None stays."""
    if isinstance(value, list | tuple):
        return type(value)(_scaled(v, ratio) for v in value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float | torch.Tensor):
        return value * ratio
    return value
