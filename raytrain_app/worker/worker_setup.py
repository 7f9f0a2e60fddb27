"""What one worker trains with, built once at its start: data, model, loaders, optimizer.

Read ``build_worker`` top to bottom: the order matters. The model is built right after
the seed is set, so every rank (and every world size) starts from identical weights; the
memory probe may re-split the batch before the loaders are sized by it; runtime
randomness (dropout) is seeded per rank last.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain_app.config import RaytrainConfig
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import ModelSpec
from raytrain_app.worker.early_stopping import EarlyStopping
from raytrain_app.worker.epoch_data import EpochData, build_epoch_data, probe_samples
from raytrain_app.worker.model_setup import prepare_for_training
from raytrain_app.worker.rank_zero import is_rank_zero, rank_zero_info
from raytrain_app.worker.recipe import configured
from raytrain_app.worker.reporting import Reporter, checkpoint_meta
from raytrain_app.worker.session import WorkerSession
from raytrain_app.worker.step import OptimizerStep
from raytrain_app.worker.stop_request import StopRequest
from raytrain_app.workloads import build_data, build_model

logger = logging.getLogger(__name__)


@dataclass
class WorkerParts:
    """A worker's data, model and training machinery, as ``WorkerLoop.setup`` keeps them."""

    device: torch.device
    data_info: dict[str, Any]
    spec: ModelSpec
    plan: TrainingPlan  # the memory probe may have re-split the batch
    module: nn.Module  # the bare module: what checkpoints hold
    loaders: EpochData
    stepper: OptimizerStep
    stopping: EarlyStopping
    stop_request: StopRequest
    reporter: Reporter


def build_worker(
    task: Any, session: WorkerSession, cfg: RaytrainConfig, plan: TrainingPlan
) -> WorkerParts:
    """Build what the worker of ``session`` trains ``task`` with, planned as ``plan``."""
    rank, world_size = session.world_rank, session.world_size
    _set_torch_flags(plan)
    device = session.device()
    # Before the model: rank 0's first question to the driver is answered meanwhile.
    stop_request = StopRequest(task.control, is_rank_zero())
    seed = cfg.experiment.seed
    ray_data = task.ray_data
    splits = ray_data.splits() if ray_data else build_data(task.data, seed)
    data_info = dict(splits.info)
    # Same seed on every rank and for every world size: identical initial weights.
    torch.manual_seed(seed)
    spec: ModelSpec = build_model(task.model, data_info)
    plan, module, model, agreement, ema = prepare_for_training(
        spec,
        plan,
        cfg.distributed,
        cfg.train,
        session,
        device,
        probe_samples(splits, plan),
        splits.batch_collate(),
    )
    loaders = _loaders(task, session, cfg, plan, splits, device)
    try:  # the loaders may have started processes: a failure below ends them
        steps = loaders.steps_per_epoch
        optimizer, scheduler = configured(
            spec, module, cfg.train, plan, steps * cfg.train.epochs, steps
        )
        stopping = EarlyStopping.of(cfg.train)
        stepper = OptimizerStep(
            model=model,
            module=module,
            spec=spec,
            plan=plan,
            train=cfg.train,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=torch.amp.GradScaler(device.type, enabled=plan.grad_scaler),
            ema=ema,
            agreement=agreement,
            device=device,
            world_size=world_size,
        )
        meta = checkpoint_meta(task, data_info)
        timeout_s = cfg.distributed.timeout_s
        reporter = Reporter(session, cfg.train, meta, world_size, device, timeout_s)
    except BaseException:
        loaders.shut_down()
        raise
    # Dropout and other runtime randomness differ per rank, as independent replicas should.
    _seed_runtime_rng(seed + 1 + rank)
    parts = WorkerParts(
        device, data_info, spec, plan, module, loaders, stepper, stopping, stop_request, reporter
    )
    rank_zero_info(logger, "plan: %s", _plan_line(parts))
    return parts


def _loaders(
    task: Any,
    session: WorkerSession,
    cfg: RaytrainConfig,
    plan: TrainingPlan,
    splits: Any,
    device: torch.device,
) -> EpochData:
    """The worker's batches: its shards of a data factory's Ray Datasets, else its
    DataLoaders over its part of the data."""
    rank, world_size = session.world_rank, session.world_size
    if task.ray_data:
        return task.ray_data.batches(plan, rank=rank, world_size=world_size, device=device)
    return build_epoch_data(
        splits,
        plan,
        cfg.dataloader,
        seed=cfg.experiment.seed,
        rank=rank,
        world_size=world_size,
        prepare=session.prepare_loader,
        stream_lanes=task.stream_lanes,
    )


def _set_torch_flags(plan: TrainingPlan) -> None:
    torch.set_num_threads(max(1, int(plan.cpus_per_worker)))
    # Both ways: cuDNN's TF32 is on by default (fp32 convolutions would not be exact
    # under an explicit fp32), and a reused Tune process must not carry a trial's TF32
    # into the next.
    torch.backends.cuda.matmul.allow_tf32 = plan.tf32
    torch.backends.cudnn.allow_tf32 = plan.tf32


def _plan_line(parts: WorkerParts) -> str:
    p, loaders = parts.plan, parts.loaders
    params = sum(t.numel() for t in parts.module.parameters())
    return (
        f"{p.world_size} worker(s) x micro-batch {p.per_worker_batch_size} x accumulation "
        f"{p.grad_accum_steps} = global batch {p.effective_batch_size}; {p.precision} on "
        f"{p.device}, {p.backend}, {p.strategy}; lr {p.lr:.3g}; {params:,} parameters; "
        f"{loaders.train_samples:,} train / {loaders.val_samples:,} val samples; "
        f"{loaders.steps_per_epoch} steps per epoch"
    )


def _seed_runtime_rng(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
