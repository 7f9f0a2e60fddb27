"""Every "auto" decision of a run, made in one place by pure functions.

The batch split, precision, backend, strategy, learning-rate rule and data-loader settings
depend only on the config and the environment, so they can be printed before anything
runs (``raytrain plan``), unit-tested without Ray, and logged once on rank 0. The number
of workers is chosen in ``planning.workers``, each other choice in ``planning.choices``;
this module puts them together into the ``TrainingPlan``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from raytrain_app.config import RaytrainConfig
from raytrain_app.planning.batch import plan_batch, scaled_lr
from raytrain_app.planning.choices import (
    check_fsdp_scope,
    choose_backend,
    choose_compile,
    choose_grad_compression,
    choose_gradient_checkpointing,
    choose_precision,
    choose_strategy,
    choose_sync_batchnorm,
    choose_use_gpu,
    enabled_outputs,
    loader_workers,
)
from raytrain_app.planning.environment import Environment
from raytrain_app.planning.gpus import check_gpus, choose_tf32, gpu_notes
from raytrain_app.planning.peak_flops import plan_peak
from raytrain_app.planning.recipe import check_schedule, describe, optimizer_recipe
from raytrain_app.planning.workers import choose_world_size, worker_range, workers_fit


@dataclass(frozen=True)
class TrainingPlan:
    """The resolved decisions for one run; ``to_dict`` is what ``raytrain plan --json`` prints."""

    world_size: int
    per_worker_batch_size: int
    grad_accum_steps: int
    effective_batch_size: int
    use_gpu: bool
    device: str
    precision: str
    grad_scaler: bool
    tf32: bool
    backend: str
    strategy: str
    sync_batchnorm: bool
    grad_compression: str
    compile: bool
    fused_optimizer: bool
    gradient_checkpointing: bool
    # The workers probe the largest micro-batch that fits the GPU and re-split the batch;
    # with gradient_checkpointing auto they turn it on first when the batch does not fit.
    memory_probe: bool
    gradient_checkpointing_auto: bool
    ema_decay: float | None  # None: no EMA of the weights
    ema_start_step: int
    timeout_s: int
    lr: float
    base_lr: float
    lr_scaling: str
    warmup_steps: int
    min_lr_ratio: float
    cpus_per_worker: float
    gpus_per_worker: float
    dataloader_workers: int
    pin_memory: bool
    keep_checkpoints: int | None  # the best N by monitor / monitor_mode, plus the newest
    monitor: str
    monitor_mode: str
    tracking: tuple[str, ...]  # outputs besides metrics.csv (tensorboard, mlflow, ...)
    # Whether the target (machine, SLURM allocation, Ray cluster) can host the workers now.
    fits: bool = True
    # The most samples one forward may take on a worker: train.max_batch_per_worker, or
    # after the memory probe what fits; None: no cap. Validation batches stay within it.
    max_batch_per_worker: int | None = None
    # (min, max) workers of an elastic run, None for a fixed size. world_size is max, the
    # size the split above is for; workers re-split for the size they get (plan_for_world_size).
    worker_range: tuple[int, int] | None = None
    # One line for each choice whose reason the summary above does not show (planning.gpus).
    notes: tuple[str, ...] = ()
    # The user's recipe, one line each (planning.recipe.describe); None: no early stopping.
    optimizer: str = ""
    schedule: str = ""
    early_stopping: str | None = None
    # What MFU is measured against (planning.peak_flops): the dense peak FLOP/s of the
    # workers' GPU at this precision, None where unknown or on CPU; and the line saying so.
    peak_flops_per_s: float | None = None
    mfu_peak: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def make_plan(cfg: RaytrainConfig, env: Environment, preview: bool = False) -> TrainingPlan:
    """Resolve every ``auto`` of ``cfg`` against ``env``.

    Args:
        preview: plan any number of workers, with a warning (and ``fits`` false) where the
            target cannot host them, as ``raytrain plan`` does; otherwise that is an error.
    """
    use_gpu = choose_use_gpu(cfg, env)
    strategy = choose_strategy(cfg.distributed.strategy, cfg.distributed.grad_compression)
    backend = choose_backend(cfg.distributed.backend, use_gpu)
    world_size = choose_world_size(cfg, env, use_gpu)
    check_gpus(cfg.scaling, env, use_gpu, world_size, backend)
    fits = workers_fit(cfg, env, use_gpu, world_size, preview)
    batch = _batch_choices(cfg, world_size, use_gpu)
    precision, grad_scaler = choose_precision(cfg.precision, use_gpu, env.gpu)
    compiled = choose_compile(cfg.optimizations.compile, use_gpu, env.gpu, strategy)
    if strategy == "fsdp":
        check_fsdp_scope(cfg, precision, compiled)
    sync_batchnorm = choose_sync_batchnorm(cfg.distributed.sync_batchnorm, strategy, world_size)
    recipe = _recipe_choices(cfg, use_gpu)
    share = cfg.scaling.gpus_per_worker if use_gpu else 0.0
    loader = cfg.dataloader
    tf32 = choose_tf32(cfg.precision, use_gpu, env.gpu)
    peak, mfu_peak = plan_peak(use_gpu, env.gpu.name if env.gpu else None, precision, tf32)
    return TrainingPlan(
        world_size=world_size,
        use_gpu=use_gpu,
        device=(env.gpu.name if env.gpu else "cuda") if use_gpu else "cpu",
        precision=precision,
        grad_scaler=grad_scaler,
        tf32=tf32,
        backend=backend,
        strategy=strategy,
        sync_batchnorm=sync_batchnorm,
        grad_compression=choose_grad_compression(
            cfg.distributed.grad_compression, backend, world_size if strategy == "ddp" else 1
        ),
        compile=compiled,
        gradient_checkpointing=choose_gradient_checkpointing(
            cfg.optimizations.gradient_checkpointing
        ),
        timeout_s=cfg.distributed.timeout_s,
        cpus_per_worker=cfg.scaling.cpus_per_worker,
        gpus_per_worker=share,
        dataloader_workers=loader_workers(cfg, env, use_gpu),
        pin_memory=use_gpu if loader.pin_memory == "auto" else loader.pin_memory,
        tracking=tuple(enabled_outputs(cfg)),
        fits=fits,
        worker_range=worker_range(cfg),
        notes=gpu_notes(
            cfg.precision, env.gpu if use_gpu else None, share, compiled, sync_batchnorm
        ),
        peak_flops_per_s=peak,
        mfu_peak=mfu_peak,
        **batch,
        **recipe,
    )


def _batch_choices(cfg: RaytrainConfig, world_size: int, use_gpu: bool) -> dict[str, Any]:
    """The batch split over ``world_size`` workers, and whether the workers probe their
    memory for it (``train.max_batch_per_worker: auto``, on GPUs)."""
    cap = cfg.train.max_batch_per_worker
    batch = plan_batch(cfg.train.global_batch_size, world_size, None if cap == "auto" else cap)
    probe = use_gpu and cap == "auto"
    return {
        "per_worker_batch_size": batch.micro_batch,
        "grad_accum_steps": batch.accum_steps,
        "effective_batch_size": batch.global_batch,
        "max_batch_per_worker": None if cap in (None, "auto") else cap,
        "memory_probe": probe,
        "gradient_checkpointing_auto": probe and cfg.optimizations.gradient_checkpointing == "auto",
        "lr": scaled_lr(
            cfg.train.lr, cfg.train.lr_scaling, batch.global_batch, cfg.train.base_batch_size
        ),
    }


def _recipe_choices(cfg: RaytrainConfig, use_gpu: bool) -> dict[str, Any]:
    """The optimizer, schedule, EMA, early stopping and checkpoint ranking, as planned."""
    train = cfg.train
    # Imported and built here once, over a stand-in parameter, as every worker builds them.
    recipe = optimizer_recipe(train, use_gpu)
    check_schedule(train, recipe)
    optimizer, schedule, early_stopping = describe(train)
    return {
        # The fused CUDA kernel: one launch for all parameters instead of one per tensor.
        "fused_optimizer": recipe.takes_fused,
        "ema_decay": train.ema.decay if train.ema.enabled else None,
        "ema_start_step": train.ema.start_step,
        "base_lr": train.lr,
        "lr_scaling": train.lr_scaling,
        "warmup_steps": train.warmup_steps,
        "min_lr_ratio": train.min_lr_ratio,
        "keep_checkpoints": train.keep_checkpoints,
        "monitor": train.monitor,
        "monitor_mode": train.mode,
        "optimizer": optimizer,
        "schedule": schedule,
        "early_stopping": early_stopping,
    }


def plan_for_world_size(plan: TrainingPlan, world_size: int) -> TrainingPlan:
    """The plan for the ``world_size`` an elastic run's workers got: the same global batch
    re-split over them, everything else unchanged (the lr, by optimizer step, too)."""
    if world_size == plan.world_size:
        return plan
    batch = plan_batch(plan.effective_batch_size, world_size, plan.max_batch_per_worker)
    return replace(
        plan,
        world_size=world_size,
        per_worker_batch_size=batch.micro_batch,
        grad_accum_steps=batch.accum_steps,
        # Nothing to compress between one worker's gradients.
        grad_compression=plan.grad_compression if world_size > 1 else "none",
    )


def resolve_config(cfg: RaytrainConfig, plan: TrainingPlan) -> RaytrainConfig:
    """The config with every ``auto`` replaced by the plan's choice (re-runnable as is)."""
    resolved = cfg.model_copy(deep=True)
    resolved.scaling.num_workers = list(plan.worker_range) if plan.worker_range else plan.world_size
    resolved.scaling.use_gpu = plan.use_gpu
    resolved.distributed.strategy = plan.strategy
    resolved.distributed.backend = plan.backend
    resolved.distributed.sync_batchnorm = plan.sync_batchnorm
    resolved.optimizations.compile = plan.compile
    resolved.precision = plan.precision
    resolved.dataloader.num_workers = plan.dataloader_workers
    resolved.dataloader.pin_memory = plan.pin_memory
    return resolved
