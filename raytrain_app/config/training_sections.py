"""The sections saying how workers train: optimisation, scaling, parallelism, loading, restarts."""

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrain_app.config.base import (
    BatchSize,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    WorkerCount,
    WorkerRange,
    _Section,
)
from raytrain_app.config.recipe_sections import (
    EarlyStoppingConfig,
    OptimizerConfig,
    ScheduleConfig,
    check_no_weight_decay,
    parse_schedule,
)

_MONITOR = re.compile(r"(train|val)_\w+")


class EmaConfig(_Section):
    """An exponential moving average of the weights, used for validation when enabled."""

    enabled: bool = Field(False, description="Keep an EMA of the weights and validate with it.")
    decay: float = Field(
        0.999, gt=0, lt=1, description="Weight of the old average at each optimizer step."
    )
    start_step: NonNegativeInt = Field(
        0, description="Optimizer steps before averaging starts (the EMA copies the weights)."
    )


class TrainConfig(_Section):
    """Optimisation: epochs, batch size, learning-rate schedule, optimizer and checkpoints."""

    epochs: PositiveInt = Field(5, description="Number of passes over the training data.")
    global_batch_size: BatchSize = Field(
        64,
        description="Effective batch size per optimizer step, the same for any number of workers.",
    )
    max_batch_per_worker: Literal["auto"] | BatchSize | None = Field(
        None,
        description="Largest micro-batch one worker may hold in memory; above it gradient "
        "accumulation keeps global_batch_size. auto probes the GPU (forward and backward of "
        "the real model) at start; null or auto on CPUs: no cap.",
    )
    lr: PositiveFloat = Field(
        1e-3, description="Peak learning rate, before any lr_scaling is applied."
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none",
        description="How lr scales with global_batch_size relative to base_batch_size.",
    )
    base_batch_size: BatchSize | None = Field(
        None,
        description="Batch size the lr was tuned for; null means global_batch_size, so "
        "scaling changes nothing.",
    )
    warmup_steps: NonNegativeInt = Field(
        0, description="Optimizer steps of linear warmup from zero to the peak lr."
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Floor of the cosine decay as a fraction of the peak lr.",
    )
    optimizer: Literal["adamw", "adam", "sgd"] | OptimizerConfig = Field(
        "adamw",
        description="adamw, adam, sgd (momentum 0.9), or {target: 'torch.optim:SGD', params: "
        "{momentum: 0.9, nesterov: true}}: any torch.optim.Optimizer (or a user's class) by "
        "import path; lr always comes from the plan.",
    )
    weight_decay: float = Field(
        0.01, ge=0, description="Weight decay coefficient passed to the optimizer."
    )
    no_weight_decay: list[str] = Field(
        default_factory=list,
        description="Parameters trained without weight decay: kinds bias, norm (any "
        "normalisation layer's weights), embedding, or fnmatch patterns of parameter names "
        "(e.g. '*.pos_embed'); empty: decay on every parameter.",
    )
    lr_multipliers: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="fnmatch pattern of parameter names -> factor of the lr for them (the "
        "first pattern that matches wins), e.g. {'backbone.*': 0.1}.",
    )
    schedule: ScheduleConfig = Field(
        default_factory=ScheduleConfig,
        description="Learning-rate schedule after warmup_steps, stepped once per optimizer "
        "step (cosine, linear, constant, step, multistep, onecycle, or a lr_scheduler class).",
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None,
        description="{patience, min_delta}: stop when monitor has not improved by min_delta "
        "for patience epochs (the best epoch is checkpointed); null: off.",
    )
    grad_clip: PositiveFloat | None = Field(
        1.0, description="Maximum global gradient norm; null disables clipping."
    )
    checkpoint_every_epochs: PositiveInt = Field(
        1, description="Save a checkpoint every this many epochs (and always after the last)."
    )
    checkpoint_every_steps: PositiveInt | None = Field(
        None,
        description="Also save a checkpoint every this many optimizer steps, mid-epoch; a "
        "resume continues at the exact next batch. null: epoch checkpoints only.",
    )
    async_checkpoints: bool = Field(
        True,
        description="Save checkpoints in the background: training stops only to copy its "
        "state into host memory (one more copy of the weights and optimizer state), then "
        "goes on while the copy is written; false writes them while training waits.",
    )
    ema: EmaConfig = Field(
        default_factory=EmaConfig, description="Exponential moving average of the weights."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="When a step's loss is NaN or infinite: stop the run naming the step (no "
        "checkpoint of it is written), or skip that optimizer step and count it.",
    )
    keep_checkpoints: PositiveInt | None = Field(
        2,
        description="Number of best checkpoints (ranked by monitor and mode) to keep, plus "
        "always the newest one, which a resume needs; null keeps all of them.",
    )
    monitor: str = Field(
        "val_loss",
        description="Epoch metric that ranks checkpoints: train_loss, val_loss, or train_/val_ "
        "followed by a metric the model's step returns (e.g. val_mae).",
    )
    mode: Literal["min", "max"] = Field(
        "min", description="Whether a smaller or a larger monitor value is better."
    )

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_name(cls, value: Any) -> Any:
        return parse_schedule(value)

    @field_validator("no_weight_decay")
    @classmethod
    def _decay_exclusions(cls, value: list[str]) -> list[str]:
        return check_no_weight_decay(value)

    @model_validator(mode="after")
    def _milestones_within_the_run(self) -> "TrainConfig":
        """An epoch milestone at or past the last epoch never takes effect."""
        s = self.schedule
        last = max([*s.milestones, s.step_size or 0]) if s.unit == "epoch" else 0
        if last >= self.epochs and s.name in ("step", "multistep"):
            raise ValueError(
                f"schedule: {s.name} at epoch {last} is past the end of a {self.epochs}-epoch "
                f"run; use milestones below train.epochs"
            )
        return self

    @field_validator("monitor")
    @classmethod
    def _epoch_metric(cls, value: str) -> str:
        """Only train_* and val_* columns are per-epoch model metrics worth ranking by."""
        if not _MONITOR.fullmatch(value):
            raise ValueError(
                "must name an epoch metric: train_loss, val_loss, or train_/val_ followed by a "
                "metric the model's step returns (e.g. val_mae)"
            )
        return value


class ScalingConfig(_Section):
    """How many Ray Train workers run and what each one reserves."""

    num_workers: Literal["auto"] | WorkerCount | WorkerRange = Field(
        "auto",
        description="Number of training workers; auto uses as many GPUs (or CPUs / "
        "cpus_per_worker) as split global_batch_size evenly; [min, max] trains elastically: "
        "Ray starts with as many as the cluster has room for, restarts with fewer when a "
        "worker or node is lost and grows when resources return, every size training with "
        "the same global batch.",
    )
    use_gpu: Literal["auto"] | bool = Field(
        "auto", description="Train on GPUs; auto uses them when the cluster has any."
    )
    cpus_per_worker: PositiveFloat = Field(1.0, description="CPUs Ray reserves for each worker.")
    gpus_per_worker: PositiveFloat = Field(
        1.0, description="GPUs Ray reserves for each worker when use_gpu is on; may be fractional."
    )
    elastic_resize_interval_s: PositiveFloat = Field(
        60.0,
        description="With num_workers [min, max]: seconds between Ray's checks for room to "
        "grow the worker group; a resize restarts the workers from the newest checkpoint.",
    )

    @field_validator("num_workers")
    @classmethod
    def _ordered_range(cls, value: Any) -> Any:
        """``[min, max]`` with min <= max; ``[n, n]`` is the fixed size n."""
        if isinstance(value, list):
            low, high = value
            if low > high:
                raise ValueError(f"[min, max] needs min <= max, got [{low}, {high}]")
            if low == high:
                return low
        return value


class DistributedConfig(_Section):
    """How workers are wrapped and how they communicate."""

    strategy: Literal["auto", "ddp", "single", "fsdp", "dp"] = Field(
        "auto",
        description="Parallel strategy: ddp (auto), single (one unwrapped worker), fsdp "
        "(FSDP2 on GPUs or CPUs: the blocks a model's fsdp_blocks() returns, else every "
        "parameter-holding item of an nn.ModuleList/nn.Sequential, else the root's children, "
        "then the root; sharded optimizer state and checkpoints, any world size on resume); "
        "dp is refused because DDP replaces it.",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="torch.distributed backend; auto picks nccl on GPUs and gloo on CPUs.",
    )
    timeout_s: PositiveInt = Field(
        600, description="Seconds a collective may wait before the process group times out."
    )
    find_unused_parameters: bool = Field(
        False,
        description="Let DDP tolerate parameters that get no gradient, at some speed cost.",
    )
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none",
        description="DDP communication hook for gradients: fp16/bf16 halve the bytes (nccl "
        "only), powersgd sends low-rank factors (any backend); once per optimizer step.",
    )
    powersgd_rank: PositiveInt = Field(
        1, description="Rank of PowerSGD's low-rank approximation; higher is more exact."
    )
    start_powersgd_iter: int = Field(
        10,
        ge=2,
        description="Optimizer steps of plain all-reduce before PowerSGD starts.",
    )
    sync_batchnorm: Literal["auto"] | bool = Field(
        "auto",
        description="Compute BatchNorm statistics over all workers' samples (SyncBatchNorm, "
        "on GPUs and CPUs); auto turns it on for ddp with more than one worker. Models without "
        "BatchNorm are unaffected.",
    )


class OptimizationsConfig(_Section):
    """Speed and memory switches that leave the optimisation itself unchanged."""

    compile: Literal["auto"] | bool = Field(
        "auto",
        description="torch.compile the model; auto turns it on for GPUs with compute "
        "capability >= 8.0.",
    )
    gradient_checkpointing: Literal["auto"] | bool = Field(
        "auto",
        description="Recompute activations in the backward pass to save memory; needs a model "
        "with gradient_checkpointing_enable(); auto turns it on when the micro-batch does not "
        "fit the GPU's memory.",
    )


class DataloaderConfig(_Section):
    """Per-worker PyTorch DataLoader settings."""

    num_workers: Literal["auto"] | NonNegativeInt = Field(
        "auto",
        description="Loader processes per training worker; auto is cpus_per_worker - 1, since "
        "the training process needs one CPU itself.",
    )
    pin_memory: Literal["auto"] | bool = Field(
        "auto", description="Pin host memory for faster copies; auto pins when training on GPUs."
    )
    persistent_workers: bool = Field(
        True,
        description="Keep loader processes alive between epochs when num_workers is above 0.",
    )
    prefetch_factor: PositiveInt = Field(
        2, description="Batches each loader process prepares ahead of time."
    )


class FaultToleranceConfig(_Section):
    """Restarts after worker failures."""

    max_failures: int = Field(
        3,
        ge=-1,
        description="Times the run restarts from its newest checkpoint after a failure; "
        "-1 means unlimited.",
    )
