"""One choice of the plan each: device, precision, backend, strategy, compile, loaders.

Every ``auto`` the config allows is resolved here against the environment, and every
combination that cannot work is refused in one line naming the key to change.
"""

from __future__ import annotations

from raytrain_app.config import RaytrainConfig
from raytrain_app.planning.batch import PlanError
from raytrain_app.planning.environment import Environment, GpuInfo
from raytrain_app.storage import is_uri


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
    """Refuse, in one line each, what FSDP has not been proven to do (docs/users/plan.md,
    "Strategy"): every other combination is tested on CPU with gloo."""
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
