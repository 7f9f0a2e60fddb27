"""Every "auto" decision of a run, made in one place by pure functions.

The batch split, precision, backend, strategy, learning-rate rule and data-loader settings
depend only on the config and the environment, so they can be printed before anything
runs (``raytrain plan``), unit-tested without Ray, and logged once on rank 0.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace

from raytrain_app.config import RaytrainConfig, ScalingConfig
from raytrain_app.config.base import MAX_BATCH_SIZE
from raytrain_app.planning.batch import PlanError, nearest_multiples, plan_batch, scaled_lr
from raytrain_app.planning.environment import Environment, GpuInfo
from raytrain_app.planning.gpus import check_gpus, choose_tf32, gpu_notes, gpu_worker_slots
from raytrain_app.planning.recipe import describe, optimizer_recipe, scheduler_class
from raytrain_app.storage import is_uri

logger = logging.getLogger(__name__)


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

    def to_dict(self) -> dict:
        return asdict(self)


def available_devices(env: Environment, use_gpu: bool, scaling: ScalingConfig) -> int:
    """How many workers the resources can host at the GPUs (or CPUs) Ray reserves for each
    (a worker never spans two nodes)."""
    if use_gpu:
        return gpu_worker_slots(env.resources, scaling.gpus_per_worker)
    per_node = env.resources.node_cpus or (env.resources.cpus,)
    return max(1, sum(int(cpus // scaling.cpus_per_worker) for cpus in per_node))


def worker_range(cfg: RaytrainConfig) -> tuple[int, int] | None:
    """``scaling.num_workers`` as ``(min, max)`` for an elastic run; None for a fixed size."""
    requested = cfg.scaling.num_workers
    return (requested[0], requested[1]) if isinstance(requested, list) else None


def choose_world_size(cfg: RaytrainConfig, env: Environment, use_gpu: bool) -> int:
    """``scaling.num_workers``, or for ``auto`` the most devices that split the batch evenly;
    for an elastic ``[min, max]``, max: the size a run starts with when there is room."""
    requested = cfg.scaling.num_workers
    devices = available_devices(env, use_gpu, cfg.scaling)
    if cfg.distributed.strategy == "single":
        if requested not in ("auto", 1):
            raise PlanError(
                f"distributed.strategy='single' trains on one worker but scaling.num_workers="
                f"{requested}; set scaling.num_workers=1 or distributed.strategy=ddp"
            )
        return 1
    if isinstance(requested, list):
        return requested[1]
    if requested != "auto":
        return requested
    global_batch = cfg.train.global_batch_size
    return max(w for w in range(1, max(devices, 1) + 1) if global_batch % w == 0)


def check_elastic_range(cfg: RaytrainConfig, low: int, high: int) -> None:
    """Every world size Ray may pick in ``[low, high]`` must split the global batch, so that
    every size trains the same optimisation (under ``train.max_batch_per_worker`` a split
    always exists: accumulation takes up the rest), and the run must be able to restart."""
    global_batch = cfg.train.global_batch_size
    if cfg.fault_tolerance.max_failures == 0:
        raise PlanError(
            f"scaling.num_workers=[{low}, {high}] continues after a lost worker by restarting, "
            f"which fault_tolerance.max_failures=0 forbids; set fault_tolerance.max_failures "
            f"above 0 (-1: unlimited)"
        )
    if cfg.distributed.grad_compression == "powersgd":
        raise PlanError(
            f"distributed.grad_compression=powersgd keeps error-feedback state that a resize "
            f"of scaling.num_workers=[{low}, {high}] would drop; set "
            f"distributed.grad_compression=none or a fixed scaling.num_workers"
        )
    bad = [w for w in range(low, high + 1) if global_batch % w]
    if not bad:
        return
    lcm = _lcm_at_most(range(low, high + 1), MAX_BATCH_SIZE)
    ranges = _valid_subranges(global_batch, low, high)
    narrower = f"scaling.num_workers={list(ranges[0])}" if ranges else "a fixed scaling.num_workers"
    if lcm is None:
        # no allowed batch is a multiple of every size: only a narrower range helps
        other = f" (no train.global_batch_size up to {MAX_BATCH_SIZE} splits over all of them)"
    else:
        batches = " or ".join(str(m) for m in nearest_multiples(global_batch, lcm))
        other = f" or set train.global_batch_size to a multiple of {lcm} (e.g. {batches})"
    raise PlanError(
        f"train.global_batch_size={global_batch} cannot be split evenly over "
        f"{_either(bad)} workers, which scaling.num_workers=[{low}, {high}] "
        f"allows; narrow it to {narrower}{other}"
    )


def _lcm_at_most(values: range, limit: int) -> int | None:
    """The least common multiple of ``values``, or None once it exceeds ``limit``: that of
    1..100000 has 43 000 digits, slow to compute and too long to print."""
    lcm = 1
    for value in values:
        lcm = math.lcm(lcm, value)
        if lcm > limit:
            return None
    return lcm


def _either(values: list[int], shown: int = 8) -> str:
    words = [str(v) for v in values[:shown]]
    if len(values) > shown:
        return f"{', '.join(words)} and {len(values) - shown} more"
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _valid_subranges(global_batch: int, low: int, high: int) -> list[tuple[int, int]]:
    """The runs of consecutive sizes inside ``[low, high]`` that split ``global_batch``,
    widest and then largest first (a single size is a fixed run, not a range)."""
    runs, start = [], None
    for w in range(low, high + 2):
        ok = w <= high and global_batch % w == 0
        if ok and start is None:
            start = w
        elif not ok and start is not None:
            if w - 1 > start:
                runs.append((start, w - 1))
            start = None
    return sorted(runs, key=lambda r: (r[1] - r[0], r[1]), reverse=True)


def hosting_problem(
    cfg: RaytrainConfig, env: Environment, use_gpu: bool, world_size: int
) -> tuple[str, bool] | None:
    """Why the target cannot host ``world_size`` workers, and whether that refuses the run:
    a machine or a SLURM allocation never grows; a Ray cluster may (an autoscaler), and Ray
    then waits for it. None when they fit."""
    devices = available_devices(env, use_gpu, cfg.scaling)
    if world_size <= devices:
        return None
    unit = (
        f"GPUs at {cfg.scaling.gpus_per_worker:g} per worker"
        if use_gpu
        else f"CPUs at {cfg.scaling.cpus_per_worker:g} per worker"
    )
    needs = f"scaling.num_workers={world_size} needs more than the {devices} workers"
    if env.resources.source == "this machine":
        return (
            f"{needs} this machine can host ({unit}); lower scaling.num_workers or pass "
            f"--address of a larger Ray cluster",
            True,
        )
    if env.slurm is not None:
        return (
            f"{needs} this SLURM allocation can host ({unit}); lower scaling.num_workers or "
            f"request more (sbatch --nodes, --gpus-per-node, --cpus-per-task)",
            True,
        )
    return (
        f"scaling.num_workers={world_size} is more than the {devices} workers the cluster can "
        f"host now ({unit}); training starts once the cluster has grown",
        False,
    )


def choose_use_gpu(cfg: RaytrainConfig, env: Environment) -> bool:
    """``scaling.use_gpu``, or for ``auto`` whether the cluster has any GPU."""
    if cfg.scaling.use_gpu == "auto":
        return env.resources.gpus > 0
    if cfg.scaling.use_gpu and env.resources.gpus == 0 and env.resources.source == "this machine":
        raise PlanError(
            "scaling.use_gpu=true but no GPU is visible; set scaling.use_gpu=auto or false, "
            "or pass --address of a Ray cluster with GPUs"
        )
    return bool(cfg.scaling.use_gpu)


def choose_precision(requested: str, use_gpu: bool, gpu: GpuInfo | None) -> tuple[str, bool]:
    """Return (precision, use_grad_scaler).

    bf16 needs compute capability 8.0 (Ampere); fp16 on older tensor-core GPUs needs a
    GradScaler because its range is too small for raw gradients.
    """
    capability = gpu.capability if (use_gpu and gpu) else None
    if requested == "auto":
        if capability is None:
            return "fp32", False
        if capability >= (8, 0):
            return "bf16", False
        return ("fp16", True) if capability >= (7, 0) else ("fp32", False)
    if requested == "fp16" and capability is None:
        raise PlanError(
            "precision=fp16 needs a CUDA GPU (CPU autocast has no fp16 kernels worth using); "
            "set precision to auto, fp32 or bf16"
        )
    if requested == "bf16" and capability is not None and capability < (8, 0):
        raise PlanError(
            f"precision=bf16 needs a GPU with compute capability >= 8.0 but {gpu.name} has "
            f"{capability[0]}.{capability[1]}; set precision to auto or fp16"
        )
    return requested, requested == "fp16"


def choose_backend(requested: str, use_gpu: bool) -> str:
    """nccl for GPUs, gloo for CPUs."""
    if requested == "auto":
        return "nccl" if use_gpu else "gloo"
    if requested == "nccl" and not use_gpu:
        raise PlanError(
            "distributed.backend=nccl needs GPUs but this run trains on CPU; "
            "set distributed.backend to auto or gloo"
        )
    return requested


def choose_strategy(requested: str, grad_compression: str = "none") -> str:
    """ddp (through ``prepare_model``), single (no wrapping) or fsdp (FSDP2, on GPUs and
    CPUs alike)."""
    if requested == "dp":
        raise PlanError(
            "distributed.strategy=dp (torch DataParallel) is not supported: DDP replaces it "
            "with one process per device and is faster; set distributed.strategy to auto or ddp"
        )
    if requested == "fsdp" and grad_compression != "none":
        # Compression hooks wrap DDP's all-reduce; FSDP reduce-scatters instead.
        raise PlanError(
            f"distributed.grad_compression={grad_compression} compresses DDP's all-reduce and "
            f"does not apply to distributed.strategy=fsdp; set distributed.grad_compression=none "
            f"or distributed.strategy=ddp"
        )
    return "ddp" if requested == "auto" else requested


def choose_sync_batchnorm(requested: str | bool, strategy: str, world_size: int) -> bool:
    """Whether BatchNorm layers become SyncBatchNorm: ``auto`` for DDP over several workers.

    With one worker there is nothing to sync; FSDP and ``single`` keep plain BatchNorm
    unless asked explicitly.
    """
    if requested == "auto":
        return strategy == "ddp" and world_size > 1
    return bool(requested)


def choose_grad_compression(requested: str, backend: str, world_size: int) -> str:
    """The DDP communication hook; with one worker nothing is communicated."""
    if world_size == 1 or requested == "none":
        return "none"
    if requested in ("fp16", "bf16") and backend != "nccl":
        raise PlanError(
            f"distributed.grad_compression={requested} needs GPUs with nccl, because gloo "
            f"cannot all-reduce {requested} tensors; use powersgd or none on CPUs"
        )
    return requested


def choose_compile(
    requested: str | bool, use_gpu: bool, gpu: GpuInfo | None, strategy: str = "ddp"
) -> bool:
    """torch.compile pays off on recent GPUs; on CPUs and older GPUs only when asked.
    FSDP runs uncompiled: no test compiles a sharded model yet."""
    if requested == "auto":
        return bool(use_gpu and gpu and gpu.capability >= (8, 0) and strategy != "fsdp")
    return bool(requested)


def check_fsdp_scope(cfg: RaytrainConfig, precision: str, compiled: bool) -> None:
    """Refuse, in one line each, what FSDP has not been proven to do (README, "Strategy"):
    every other combination is tested on CPU with gloo."""
    problems = {
        "optimizations.compile=true": compiled,
        # The GradScaler over shards has no test, and bf16/fp32 need none.
        "precision=fp16": precision == "fp16",
        # The memory probe measures the unsharded model, which FSDP exists to avoid.
        "train.max_batch_per_worker=auto": cfg.train.max_batch_per_worker == "auto",
        # Shards are uploaded to a filesystem path only (tests/distributed/test_fsdp.py).
        f"experiment.output_dir={cfg.experiment.output_dir}": is_uri(cfg.experiment.output_dir),
    }
    for setting, present in problems.items():
        if present:
            key = setting.split("=")[0]
            raise PlanError(
                f"{setting} is not supported with distributed.strategy=fsdp yet; change "
                f"{key} or set distributed.strategy=ddp"
            )


def choose_gradient_checkpointing(requested: str | bool) -> bool:
    """``auto`` stays off until the worker's memory probe finds the micro-batch too big."""
    return requested is True


def loader_workers(cfg: RaytrainConfig, env: Environment, use_gpu: bool) -> int:
    """DataLoader processes per training worker: its CPUs minus the one that trains.

    On SLURM GPU jobs a worker's share is the task's CPUs over the node's GPUs (one worker
    per GPU), which is usually more than the ``cpus_per_worker`` Ray reserves.
    """
    if cfg.dataloader.num_workers != "auto":
        return cfg.dataloader.num_workers
    cpus = cfg.scaling.cpus_per_worker
    slurm = env.slurm
    if use_gpu and slurm and slurm.cpus_per_task and slurm.gpus_per_node:
        cpus = slurm.cpus_per_task // slurm.gpus_per_node
    return max(int(cpus) - 1, 0)


def enabled_outputs(cfg: RaytrainConfig) -> list[str]:
    """The tracking outputs a run writes besides metrics.csv, for the plan printout."""
    t = cfg.tracking
    names = {"tensorboard": t.tensorboard, "mlflow": t.mlflow, "wandb": t.wandb}
    return [name for name, on in names.items() if on] + (["loss.png"] if t.loss_plot else [])


def _check_hosting(
    cfg: RaytrainConfig, env: Environment, use_gpu: bool, world_size: int, preview: bool
) -> bool:
    """Whether the workers fit; refuses what never will unless previewing, warns otherwise."""
    problem = hosting_problem(cfg, env, use_gpu, world_size)
    if problem is None:
        return True
    message, refused = problem
    if refused and not preview:
        raise PlanError(message)
    logger.warning("%s", message)
    return False


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
    elastic = worker_range(cfg)
    if elastic:
        check_elastic_range(cfg, *elastic)
        # The run needs room for min workers; it grows to max as the cluster allows.
        fits = _check_hosting(cfg, env, use_gpu, elastic[0], preview)
        if fits and hosting_problem(cfg, env, use_gpu, world_size):
            logger.info(
                "scaling.num_workers=%s: %d workers fit now; the run grows when more do",
                list(elastic),
                available_devices(env, use_gpu, cfg.scaling),
            )
    else:
        fits = _check_hosting(cfg, env, use_gpu, world_size, preview)
    cap = cfg.train.max_batch_per_worker
    batch = plan_batch(cfg.train.global_batch_size, world_size, None if cap == "auto" else cap)
    precision, grad_scaler = choose_precision(cfg.precision, use_gpu, env.gpu)
    compiled = choose_compile(cfg.optimizations.compile, use_gpu, env.gpu, strategy)
    if strategy == "fsdp":
        check_fsdp_scope(cfg, precision, compiled)
    sync_batchnorm = choose_sync_batchnorm(cfg.distributed.sync_batchnorm, strategy, world_size)
    share = cfg.scaling.gpus_per_worker if use_gpu else 0.0
    loader = cfg.dataloader
    recipe = optimizer_recipe(cfg.train, use_gpu)  # imported and checked here, once
    scheduler_class(cfg.train.schedule)
    optimizer, schedule, early_stopping = describe(cfg.train)
    return TrainingPlan(
        world_size=world_size,
        per_worker_batch_size=batch.micro_batch,
        grad_accum_steps=batch.accum_steps,
        effective_batch_size=batch.global_batch,
        use_gpu=use_gpu,
        device=(env.gpu.name if env.gpu else "cuda") if use_gpu else "cpu",
        precision=precision,
        grad_scaler=grad_scaler,
        tf32=choose_tf32(cfg.precision, use_gpu, env.gpu),
        backend=backend,
        strategy=strategy,
        sync_batchnorm=sync_batchnorm,
        grad_compression=choose_grad_compression(
            cfg.distributed.grad_compression, backend, world_size if strategy == "ddp" else 1
        ),
        compile=compiled,
        # The fused CUDA kernel: one launch for all parameters instead of one per tensor.
        fused_optimizer=recipe.takes_fused,
        gradient_checkpointing=choose_gradient_checkpointing(
            cfg.optimizations.gradient_checkpointing
        ),
        memory_probe=use_gpu and cap == "auto",
        gradient_checkpointing_auto=use_gpu
        and cap == "auto"
        and cfg.optimizations.gradient_checkpointing == "auto",
        ema_decay=cfg.train.ema.decay if cfg.train.ema.enabled else None,
        ema_start_step=cfg.train.ema.start_step,
        timeout_s=cfg.distributed.timeout_s,
        lr=scaled_lr(
            cfg.train.lr, cfg.train.lr_scaling, batch.global_batch, cfg.train.base_batch_size
        ),
        base_lr=cfg.train.lr,
        lr_scaling=cfg.train.lr_scaling,
        warmup_steps=cfg.train.warmup_steps,
        min_lr_ratio=cfg.train.min_lr_ratio,
        cpus_per_worker=cfg.scaling.cpus_per_worker,
        gpus_per_worker=share,
        dataloader_workers=loader_workers(cfg, env, use_gpu),
        pin_memory=use_gpu if loader.pin_memory == "auto" else loader.pin_memory,
        keep_checkpoints=cfg.train.keep_checkpoints,
        monitor=cfg.train.monitor,
        monitor_mode=cfg.train.mode,
        tracking=tuple(enabled_outputs(cfg)),
        fits=fits,
        max_batch_per_worker=None if cap in (None, "auto") else cap,
        worker_range=elastic,
        notes=gpu_notes(
            cfg.precision, env.gpu if use_gpu else None, share, compiled, sync_batchnorm
        ),
        optimizer=optimizer,
        schedule=schedule,
        early_stopping=early_stopping,
    )


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
