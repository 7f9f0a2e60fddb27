"""The user's optimizer and schedule, resolved and checked before any worker starts.

``train.optimizer`` and ``train.schedule`` may name classes by import path: here they are
imported, their params checked against the signature and tried once on a dummy parameter,
so that a typo is a one-line error naming the key on the driver, not a failure in every
worker. A built-in name needs no try: its arguments are the schema's, already checked.
The schedule's multiplier of the peak lr is a pure function of the optimizer step
(``lr_multiplier``), so 1, 2 or 64 workers see the same lr at the same global step.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain_app.config import TrainConfig
from raytrain_app.config.recipe_sections import ScheduleConfig
from raytrain_app.errors import BadInputError
from raytrain_app.planning.batch import lr_factor

if TYPE_CHECKING:  # torch is imported where a class is checked: the job client plans nothing
    import torch

# What the built-in names mean (sgd keeps today's momentum 0.9 without Nesterov).
_NAMED = {
    "adamw": ("torch.optim:AdamW", {}),
    "adam": ("torch.optim:Adam", {}),
    "sgd": ("torch.optim:SGD", {"momentum": 0.9}),
}
# Set from train.lr / train.weight_decay and the parameter groups, never from params.
_RESERVED = ("params", "lr", "weight_decay")
# Needs a metric per call: raytrain steps every scheduler once per optimizer step.
_REFUSED_SCHEDULERS = ("ReduceLROnPlateau",)


class RecipeError(BadInputError):
    """A train.optimizer / train.schedule value that cannot be built; one line."""


@dataclass(frozen=True)
class OptimizerRecipe:
    """The optimizer class and the keyword arguments a worker builds it with (not lr)."""

    target: str
    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    takes_weight_decay: bool
    takes_fused: bool

    def build(self, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
        """The optimizer over ``groups`` (``parameter_group``s): what every worker trains
        with, and what the driver tries once over a stand-in parameter."""
        if not self.takes_weight_decay:
            groups = [{k: v for k, v in g.items() if k != "weight_decay"} for g in groups]
        return self.cls(groups, lr=lr, **self.kwargs)


def parameter_group(params: list[Any], weight_decay: float, lr: float, factor: float) -> dict:
    """One parameter group as the workers build them (``worker.recipe.param_groups``)."""
    return {
        "params": params,
        "weight_decay": weight_decay,
        "lr": lr * factor,
        "lr_multiplier": factor,
    }


def _stand_in(recipe: OptimizerRecipe, train: TrainConfig) -> torch.optim.Optimizer:
    """``recipe`` built over one stand-in parameter on the CPU, as a worker builds it."""
    import torch

    group = parameter_group([torch.nn.Parameter(torch.zeros(1))], train.weight_decay, train.lr, 1.0)
    return recipe.build([group], train.lr)


def import_target(target: str, key: str) -> Any:
    """``package.module:Attr`` imported; a one-line error naming ``key`` otherwise."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise RecipeError(
            f"{key}: cannot import '{target}' ({exc}); give an importable "
            f"'package.module:Class' such as 'torch.optim:SGD'"
        ) from None
    return obj


def _accepted(cls: type, key: str, params: dict[str, Any], skip: int) -> set[str]:
    """The keyword names ``cls`` takes; params it does not take are an error."""
    signature = inspect.signature(cls.__init__)
    names = list(signature.parameters)[1 + skip :]  # self, then the positional ones
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return set(names) | set(params)
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise RecipeError(
            f"{key}.params: {cls.__name__} does not accept {', '.join(unknown)}; it takes "
            f"{', '.join(n for n in names if n not in _RESERVED)}"
        )
    return set(names)


def optimizer_recipe(train: TrainConfig, use_gpu: bool = False) -> OptimizerRecipe:
    """Resolve and check ``train.optimizer``; fused on GPUs where the class offers it."""
    import torch

    if isinstance(train.optimizer, str):
        target, params = _NAMED[train.optimizer]
    else:
        target, params = train.optimizer.target, dict(train.optimizer.params)
    cls = import_target(target, "train.optimizer.target")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RecipeError(
            f"train.optimizer.target: '{target}' is not a torch.optim.Optimizer subclass"
        )
    reserved = sorted(set(params) & set(_RESERVED))
    if reserved:
        raise RecipeError(
            f"train.optimizer.params: {', '.join(reserved)} is set by raytrain; use train.lr "
            f"and train.weight_decay instead"
        )
    accepted = _accepted(cls, "train.optimizer", params, skip=1)
    takes_decay = "weight_decay" in accepted
    if not takes_decay and (train.weight_decay or train.no_weight_decay):
        raise RecipeError(
            f"train.weight_decay: {cls.__name__} takes no weight_decay; set "
            f"train.weight_decay=0 and train.no_weight_decay=[]"
        )
    recipe = OptimizerRecipe(target, cls, params, takes_decay, takes_fused=False)
    # The fused kernel where the class offers it, unless the params ask for another
    # implementation (foreach, differentiable), which torch refuses beside fused=True.
    implementation = params.get("foreach") or params.get("differentiable")
    if use_gpu and "fused" in accepted and "fused" not in params and not implementation:
        fused = OptimizerRecipe(target, cls, {**params, "fused": True}, takes_decay, True)
        if _error(lambda: _stand_in(fused, train)) is None:
            return fused
    if isinstance(train.optimizer, str):
        # A built-in name takes only lr (> 0) and weight_decay (>= 0), which the schema
        # checked: it builds. Building it here would import torch._dynamo (every torch
        # optimizer's constructor does), 1.4 s of CPU beside the embedded Ray's start.
        return recipe
    _try_optimizer(recipe, train)
    return recipe


def _error(build: Callable[[], Any]) -> str | None:
    """The first line of what ``build`` raises (any exception: a user's class may raise
    anything), or None when it builds."""
    try:
        build()
    except Exception as exc:  # every failure becomes one line naming the key
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"{text} ({type(exc).__name__})" if text else type(exc).__name__
    return None


def _try_optimizer(recipe: OptimizerRecipe, train: TrainConfig) -> None:
    """Build it once over a stand-in parameter with the workers' arguments: bad values
    (nesterov without momentum, fused beside foreach) fail here, not in every worker."""
    error = _error(lambda: _stand_in(recipe, train))
    if error is not None:
        raise RecipeError(
            f"train.optimizer: {recipe.cls.__name__}({_show(recipe.kwargs)}) fails: {error}; "
            f"fix train.optimizer.params"
        )


def scheduler_class(schedule: ScheduleConfig) -> type | None:
    """The lr_scheduler class ``schedule.target`` names (checked), or None for a name."""
    if schedule.target is None:
        return None
    import torch

    cls = import_target(schedule.target, "train.schedule.target")
    base = torch.optim.lr_scheduler.LRScheduler
    if not (isinstance(cls, type) and issubclass(cls, base)) or (
        cls.__name__ in _REFUSED_SCHEDULERS
    ):
        raise RecipeError(
            f"train.schedule.target: '{schedule.target}' is not a scheduler raytrain can step "
            f"once per optimizer step (a torch.optim.lr_scheduler.LRScheduler other than "
            f"ReduceLROnPlateau); use early stopping or a name such as step"
        )
    _accepted(cls, "train.schedule", schedule.params, skip=1)
    return cls


def build_schedule(
    optimizer: torch.optim.Optimizer, train: TrainConfig, total_steps: int, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """``train.schedule`` after ``train.warmup_steps``, stepped once per optimizer step:
    what every worker steps, and what the driver tries once (``check_schedule``)."""
    import torch

    schedule, lr_scheduler = train.schedule, torch.optim.lr_scheduler
    cls = scheduler_class(schedule)
    if cls is None:
        return lr_scheduler.LambdaLR(optimizer, lr_multiplier(train, total_steps, steps_per_epoch))
    warmup = train.warmup_steps
    if not warmup:
        return cls(optimizer, **schedule.params)
    ramp = lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / warmup)
    user = cls(optimizer, **schedule.params)
    return lr_scheduler.SequentialLR(optimizer, [ramp, user], milestones=[warmup])


def check_schedule(train: TrainConfig, recipe: OptimizerRecipe) -> None:
    """Build ``train.schedule`` once over a stand-in optimizer, as the workers do, and step
    a target's class once (a step_size of 0 divides by zero only then): a missing or bad
    param is one line naming the key, not a failure in every worker."""
    import warnings

    cls = scheduler_class(train.schedule)
    params = train.schedule.params

    def first_steps() -> None:
        if cls is None:  # a named schedule is a pure function of the step: no optimizer
            multiplier = lr_multiplier(train, train.warmup_steps + 1, 1)
            multiplier(0), multiplier(train.warmup_steps)  # LambdaLR's first, the first after
            return
        with warnings.catch_warnings():  # torch warns of a scheduler stepped before its optimizer
            warnings.simplefilter("ignore")
            build_schedule(_stand_in(recipe, train), train, train.warmup_steps + 1, 1)
            if cls is not None:
                cls(_stand_in(recipe, train), **params).step()

    error = _error(first_steps)
    if error is not None:
        what = f"{cls.__name__}({_show(params)})" if cls else (train.schedule.name or "")
        raise RecipeError(f"train.schedule: {what} fails: {error}; fix train.schedule.params")


def check_schedule_length(schedule: ScheduleConfig, total_steps: int, steps_per_epoch: int) -> None:
    """A step or multistep position at or past the run's last optimizer step is an error."""
    if schedule.name not in ("step", "multistep"):
        return
    positions = [*schedule.milestones, schedule.step_size or 0]
    unit = steps_per_epoch if schedule.unit == "epoch" else 1
    last = max(positions) * unit
    if last >= total_steps:
        raise RecipeError(
            f"train.schedule: {schedule.name} at {schedule.unit} {max(positions)} (step "
            f"{last}) is past the end of the run's {total_steps} optimizer steps; lower "
            f"train.schedule.milestones/step_size or use unit: epoch"
        )


def lr_multiplier(
    train: TrainConfig, total_steps: int, steps_per_epoch: int
) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): warmup, then the
    named schedule over the remaining steps."""
    s, warmup, floor = train.schedule, train.warmup_steps, train.min_lr_ratio
    unit = steps_per_epoch if s.unit == "epoch" else 1
    if s.name == "cosine":  # today's rule, unchanged
        return lambda step: lr_factor(step, warmup, total_steps, floor)

    def shape(step: int) -> float:
        done = step - warmup  # steps since warmup ended
        progress = min(done / max(total_steps - warmup, 1), 1.0)
        if s.name == "linear":
            return floor + (1 - floor) * (1 - progress)
        if s.name == "step":
            return s.gamma ** (step // (s.step_size * unit))
        if s.name == "multistep":
            return s.gamma ** sum(step >= m * unit for m in s.milestones)
        if s.name == "onecycle":
            return _one_cycle(progress, s.pct_start)
        return 1.0  # constant

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return shape(step)

    return multiplier


def _one_cycle(progress: float, pct_start: float) -> float:
    """torch's OneCycleLR (cosine, div_factor 25, final_div_factor 1e4) as a fraction of
    the peak: up from 1/25 over pct_start of the steps, then down to 1/25e4."""
    start, end = 1 / 25, 1 / 25e4
    if progress < pct_start:
        low, high, t = start, 1.0, progress / pct_start
    else:
        low, high, t = 1.0, end, (progress - pct_start) / (1 - pct_start)
    return high + (low - high) / 2 * (1 + math.cos(math.pi * t))


def describe(train: TrainConfig) -> tuple[str, str, str | None]:
    """One line each for the optimizer, the schedule and early stopping (``raytrain plan``)."""
    opt = train.optimizer
    target, params = _NAMED[opt] if isinstance(opt, str) else (opt.target, opt.params)
    decay = f"weight_decay {train.weight_decay:g}"
    if train.no_weight_decay:
        decay += f" except {', '.join(train.no_weight_decay)}"
    mult = "".join(f", lr x{v:g} for {k}" for k, v in train.lr_multipliers.items())
    optimizer = f"{target.split(':')[-1]}({_show(params)}), {decay}{mult}"
    s = train.schedule
    what = s.target or s.name
    if s.name in ("step", "multistep"):
        where = s.milestones if s.name == "multistep" else f"every {s.step_size}"
        what = f"{s.name} x{s.gamma:g} at {s.unit} {where}"
    elif s.target:
        what = f"{s.target}({_show(s.params)})"
    schedule = f"warmup {train.warmup_steps} steps, then {what}"
    es = train.early_stopping
    stopping = f"patience {es.patience}, min_delta {es.min_delta:g}" if es else None
    return optimizer, schedule, stopping


def _show(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items())
