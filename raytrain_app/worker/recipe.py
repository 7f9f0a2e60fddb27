"""The optimizer, its parameter groups and the lr schedule a worker trains with.

Parameter groups. The default keeps today's results: one group, weight decay on every
parameter, so existing configs train and resume exactly as before. ``train.no_weight_decay``
opts into current practice (timm's ``param_groups_weight_decay``: no decay on biases,
normalisation weights and embeddings, as transformer recipes do), and
``train.lr_multipliers`` scales the lr of the parameters whose names match a pattern.
Groups are ordered by first appearance, so every rank and every resume builds the same
layout, and an unchanged layout keeps the optimizer state's indices.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from raytrain_app.config import TrainConfig
from raytrain_app.errors import BadInputError
from raytrain_app.planning.recipe import (
    build_schedule,
    check_schedule_length,
    optimizer_recipe,
    parameter_group,
)
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import ModelSpec

Scheduler = torch.optim.lr_scheduler.LRScheduler


def param_kind(module: nn.Module, name: str) -> set[str]:
    """The kinds of ``name`` no_weight_decay can name: bias, norm, embedding."""
    kinds = {"bias"} if name.rsplit(".", 1)[-1] == "bias" else set()
    owner = type(module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module)
    if "Norm" in owner.__name__ or issubclass(owner, nn.modules.batchnorm._NormBase):
        kinds.add("norm")
    if issubclass(owner, nn.Embedding | nn.EmbeddingBag) or "Embedding" in owner.__name__:
        kinds.add("embedding")
    return kinds


def param_groups(module: nn.Module, train: TrainConfig, lr: float) -> list[dict[str, Any]]:
    """``module``'s trainable parameters in groups of (weight decay, lr multiplier)."""
    groups: dict[tuple[float, float], dict[str, Any]] = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        excluded = any(
            rule in param_kind(module, name) or fnmatchcase(name, rule)
            for rule in train.no_weight_decay
        )
        decay = 0.0 if excluded else train.weight_decay
        factor = next((v for k, v in train.lr_multipliers.items() if fnmatchcase(name, k)), 1.0)
        group = groups.setdefault((decay, factor), parameter_group([], decay, lr, factor))
        group["params"].append(param)
    return list(groups.values())


def build_optimizer(
    module: nn.Module, train: TrainConfig, plan: TrainingPlan
) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``module``'s parameter groups at the plan's lr (built as
    the driver tried it: ``planning.recipe``)."""
    recipe = optimizer_recipe(train, plan.fused_optimizer)
    return recipe.build(param_groups(module, train, plan.lr), plan.lr)


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainConfig, total_steps: int, steps_per_epoch: int
) -> Scheduler:
    """``train.schedule`` after ``train.warmup_steps``, stepped once per optimizer step."""
    check_schedule_length(train.schedule, total_steps, steps_per_epoch)
    return build_schedule(optimizer, train, total_steps, steps_per_epoch)


def configured(
    spec: ModelSpec,
    module: nn.Module,
    train: TrainConfig,
    plan: TrainingPlan,
    total_steps: int,
    steps_per_epoch: int,
) -> tuple[torch.optim.Optimizer, Scheduler]:
    """The optimizer and scheduler: the model's ``configure_optimizers`` hook when it has
    one (no scheduler: a constant lr), else the config's recipe."""
    check_hook_alone(spec, train)
    hook = spec.configure_optimizers
    if hook is None:
        optimizer = build_optimizer(module, train, plan)
        return optimizer, build_scheduler(optimizer, train, total_steps, steps_per_epoch)
    optimizer, scheduler = hook(module, plan.lr, total_steps)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise BadInputError(
            "ModelSpec.configure_optimizers must return (optimizer, scheduler or None), got "
            f"{type(optimizer).__name__} first"
        )
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return optimizer, scheduler


def check_hook_alone(spec: ModelSpec, train: TrainConfig) -> None:
    """With ``configure_optimizers`` the recipe keys would be silently ignored: refuse them."""
    if spec.configure_optimizers is None:
        return
    default = TrainConfig()
    keys = ("optimizer", "weight_decay", "no_weight_decay", "lr_multipliers", "schedule")
    keys += ("warmup_steps", "min_lr_ratio")
    changed = [k for k in keys if getattr(train, k) != getattr(default, k)]
    if changed:
        raise BadInputError(
            f"the model's ModelSpec.configure_optimizers builds the optimizer and schedule, "
            f"but train.{', train.'.join(changed)} is set too; remove "
            f"{'them' if len(changed) > 1 else 'it'} from the config or drop the hook"
        )
