"""The model as each worker trains it, built around the user's bare module from outside:
gradient checkpointing, the memory probe, SyncBatchNorm, DDP (or FSDP), communication hooks, the
per-step agreement, the EMA and torch.compile, in that order."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from raytrain_app.config import DistributedConfig, TrainConfig
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import CollateFn, ModelSpec, collate
from raytrain_app.worker.compile_cache import use_private_compile_cache
from raytrain_app.worker.fsdp import shard_model_and_ema
from raytrain_app.worker.memory_probe import fit_plan_to_memory
from raytrain_app.worker.model_companions import make_ema, register_comm_hook
from raytrain_app.worker.rank_zero import rank_zero_info
from raytrain_app.worker.session import WorkerSession
from raytrain_app.worker.step import autocast_for
from raytrain_app.worker.step_agreement import StepAgreement
from raytrain_app.worker.sync_batchnorm import convert_sync_batchnorm, has_batchnorm

logger = logging.getLogger(__name__)


def prepare_for_training(
    spec: ModelSpec,
    plan: TrainingPlan,
    distributed: DistributedConfig,
    train: TrainConfig,
    session: WorkerSession,
    device: torch.device,
    train_data: Any,
    collate: CollateFn = collate,
) -> tuple[TrainingPlan, nn.Module, nn.Module, StepAgreement, AveragedModel | None]:
    """Returns the plan (the memory probe may re-split the batch), the bare module (what
    checkpoints hold), the model as trained, the step agreement and the EMA (or None).

    ``train_data`` and ``collate`` give the memory probe its batches, ``train`` the
    optimizer whose state it holds room for."""
    world_size = session.world_size
    module = spec.module
    if plan.gradient_checkpointing:  # the driver checked the model has the hook
        module.gradient_checkpointing_enable()
    if plan.memory_probe:
        # Before SyncBatchNorm: the probe must run no collective, since ranks run out of
        # memory at different sizes and would pair different calls (memory_probe.py).
        plan = fit_plan_to_memory(
            plan,
            spec,
            module,
            train_data,
            lambda: autocast_for(plan.precision, device),
            device,
            world_size,
            train,
            collate,
        )
    if plan.sync_batchnorm and has_batchnorm(module):
        # Before DDP wraps it; the converted layers keep BatchNorm's state-dict keys.
        module = convert_sync_batchnorm(module, device)
        rank_zero_info(logger, "BatchNorm layers synchronised across workers (SyncBatchNorm)")
    if plan.strategy == "fsdp":  # sharded in place, with its EMA (fsdp.py)
        model, ema = shard_model_and_ema(module.to(device), plan.ema_decay, device, plan.precision)
    else:
        ddp_kwargs = {"find_unused_parameters": distributed.find_unused_parameters}
        model = session.prepare_model(
            module, plan.strategy, ddp_kwargs if plan.strategy == "ddp" else {}
        )
        ema = make_ema(module, plan.ema_decay)
    register_comm_hook(
        model, plan.grad_compression, distributed.powersgd_rank, distributed.start_powersgd_iter
    )
    # The per-step flags ride on DDP's gradient all-reduce unless a hook owns it; under
    # compile too, since DDP's reducer (and so its hook) runs outside the compiled graphs.
    fuse = plan.grad_compression == "none"
    agreement = StepAgreement(model, world_size, fuse, read_late=device.type == "cuda")
    if plan.compile:
        # Compiles the DDP-wrapped model, so Dynamo splits graphs at DDP's buckets and
        # the gradient all-reduce overlaps the backward; DDP's no_sync still holds (see
        # step.py). Checkpoints store the plain module's state_dict (no "_orig_mod.").
        use_private_compile_cache()  # compiled code is loaded from there: no one else's
        model = torch.compile(model)
    return plan, module, model, agreement, ema
