"""The config schema: every section, key, type, constraint and default, in one place.

These pydantic models are the single source of truth for the YAML keys; ``config.py``
loads YAML and ``--set`` overrides on top of them and turns validation errors into
one-line messages.
"""

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raytrain_app.errors import BadInputError

_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_MONITOR = re.compile(r"(train|val)_\w+")
_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class ConfigError(BadInputError):
    """A bad config, file or override; ``str()`` is one sentence the CLI prints before exiting 2."""

    def __init__(self, message: str) -> None:
        # the CLI prints exactly one line, so no stray newline may survive from nested messages
        super().__init__(" ".join(message.splitlines()))


# --------------------------------------------------------------------------- schema


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors and values are never coerced."""

    # strict: YAML already types its scalars, so coercing "yes" to a bool or 64.5 to an int
    # would only hide mistakes (ints are still accepted where floats are expected)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class ExperimentConfig(_Section):
    """Names the run and where its run directory lives."""

    name: str = Field(
        "quickstart",
        description="Run name, also the run directory's name under output_dir "
        "(letters, digits, '.', '_' and '-').",
    )
    output_dir: NonEmptyStr = Field(
        "runs", description="Folder holding one run directory per experiment name."
    )
    seed: NonNegativeInt = Field(
        0, description="Seed for model initialisation, data generation and shuffling."
    )

    @field_validator("name")
    @classmethod
    def _safe_directory_name(cls, value: str) -> str:
        """Reject names that would escape output_dir or make awkward directory names."""
        if not _SAFE_NAME.fullmatch(value):
            raise ValueError(
                "must be letters, digits, '.', '_' or '-', starting with a letter, digit or '_'"
            )
        return value


class _OneSource(_Section):
    """A section that names its workload by exactly one of ``SOURCE_KEYS``."""

    SOURCE_KEYS: ClassVar[tuple[str, ...]] = ("name", "target")

    @field_validator("target", check_fields=False)
    @classmethod
    def _importable_target(cls, value: str | None) -> str | None:
        """Check the ``package.module:attribute`` form early, before any worker imports it."""
        if value is not None and not _TARGET.fullmatch(value):
            raise ValueError("must look like 'package.module:attribute'")
        return value

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "_OneSource":
        """Keep exactly one source; a path or target the user gives replaces the default name."""
        chosen = [key for key in self.SOURCE_KEYS if getattr(self, key) is not None]
        if len(chosen) > 1 and "name" not in self.model_fields_set:
            # bypass validate_assignment: we are already inside validation
            self.__dict__["name"] = None
            chosen.remove("name")
        if len(chosen) > 1:
            raise ValueError(
                f"{' and '.join(chosen)} are set together; keep exactly one of "
                f"{', '.join(self.SOURCE_KEYS)}"
            )
        if not chosen:
            raise ValueError(f"set exactly one of {', '.join(self.SOURCE_KEYS)}")
        return self


class ModelConfig(_OneSource):
    """Chooses the model: a built-in by name or a user factory by import target."""

    name: str | None = Field(
        "wind_transformer",
        description="Built-in model to train; cleared automatically when target is given.",
    )
    target: str | None = Field(
        None,
        description="User model factory as 'package.module:attribute', used instead of a "
        "built-in name.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword parameters passed unchanged to the model factory.",
    )


class DataConfig(_OneSource):
    """Chooses the data: a built-in generator, Parquet files, or a user factory."""

    SOURCE_KEYS: ClassVar[tuple[str, ...]] = ("name", "path", "target")

    name: str | None = Field(
        "synthetic_wind",
        description="Built-in dataset; cleared automatically when path or target is given.",
    )
    path: NonEmptyStr | None = Field(
        None, description="Parquet file or glob pattern of Parquet files to train on."
    )
    target: str | None = Field(
        None,
        description="User data factory as 'package.module:attribute', used instead of a "
        "built-in name or a path.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword parameters passed unchanged to the dataset builder or factory.",
    )


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
    global_batch_size: PositiveInt = Field(
        64,
        description="Effective batch size per optimizer step, the same for any number of workers.",
    )
    max_batch_per_worker: Literal["auto"] | PositiveInt | None = Field(
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
    base_batch_size: PositiveInt | None = Field(
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
    optimizer: Literal["adamw", "adam", "sgd"] = Field(
        "adamw", description="Optimizer used for every parameter."
    )
    weight_decay: float = Field(
        0.01, ge=0, description="Weight decay coefficient passed to the optimizer."
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

    num_workers: Literal["auto"] | PositiveInt = Field(
        "auto",
        description="Number of training workers; auto uses as many GPUs (or CPUs / "
        "cpus_per_worker) as split global_batch_size evenly.",
    )
    use_gpu: Literal["auto"] | bool = Field(
        "auto", description="Train on GPUs; auto uses them when the cluster has any."
    )
    cpus_per_worker: PositiveFloat = Field(1.0, description="CPUs Ray reserves for each worker.")
    gpus_per_worker: PositiveFloat = Field(
        1.0, description="GPUs Ray reserves for each worker when use_gpu is on; may be fractional."
    )


class DistributedConfig(_Section):
    """How workers are wrapped and how they communicate."""

    strategy: Literal["auto", "ddp", "single", "fsdp", "dp"] = Field(
        "auto",
        description="Parallel strategy: ddp (auto), single (one unwrapped worker), fsdp (GPUs "
        "only); dp is refused because DDP replaces it.",
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


class TuneConfig(_Section):
    """The Ray Tune sweep run by ``raytrain tune``."""

    num_samples: PositiveInt = Field(8, description="Number of trials to sample.")
    metric: NonEmptyStr = Field("val_loss", description="Reported metric that ranks trials.")
    mode: Literal["min", "max"] = Field(
        "min", description="Whether a smaller or a larger metric is better."
    )
    scheduler: Literal["asha", "fifo", "pbt"] = Field(
        "asha", description="Trial scheduler; asha stops poor trials early."
    )
    search: Literal["random", "grid", "optuna"] = Field(
        "random", description="Search algorithm that proposes hyperparameters."
    )
    param_space: dict[str, Any] = Field(
        default_factory=dict,
        description="Dotted config keys mapped to the distributions or values to sweep.",
    )
    max_concurrent_trials: PositiveInt | None = Field(
        None, description="Most trials running at once; null lets the cluster size decide."
    )
    grace_period: PositiveInt = Field(
        1, description="Epochs every trial runs before the scheduler may stop it."
    )
    reduction_factor: float = Field(
        2.0, gt=1, description="Fraction 1/reduction_factor of trials ASHA keeps at each rung."
    )
    max_failures: NonNegativeInt = Field(
        0, description="Times a failed trial is retried before it counts as errored."
    )


class TrackingConfig(_Section):
    """Where rank 0 logs metrics besides metrics.csv, and the loss plot."""

    tensorboard: bool = Field(
        True,
        description="Write TensorBoard event files (tensorboardX) to tensorboard/ in the run "
        "directory.",
    )
    mlflow: bool = Field(
        False,
        description="Log to MLflow, by default to a file store in mlruns/ in the run directory; "
        "needs the mlflow extra.",
    )
    mlflow_tracking_uri: NonEmptyStr | None = Field(
        None,
        description="MLflow tracking URI (a server or a database); null: the file store in the "
        "run directory.",
    )
    wandb: bool = Field(
        False,
        description="Log to Weights & Biases in offline mode, in wandb/ in the run directory "
        "(upload later with 'wandb sync'); needs the wandb extra.",
    )
    wandb_project: NonEmptyStr = Field("raytrain", description="W&B project of the run.")
    log_every_steps: PositiveInt = Field(
        10,
        description="Log rank 0's step loss and the lr every this many optimizer steps; epoch "
        "metrics are logged at every epoch's end.",
    )
    loss_plot: bool = Field(
        True,
        description="Draw train and val loss per epoch into loss.png in the run directory at the "
        "end of the run (needs matplotlib: the plot extra).",
    )


class RaytrainConfig(_Section):
    """The complete configuration of a training run or sweep."""

    experiment: ExperimentConfig = Field(
        default_factory=ExperimentConfig, description="Run name, output folder and seed."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model to train.")
    data: DataConfig = Field(default_factory=DataConfig, description="Data to train on.")
    train: TrainConfig = Field(
        default_factory=TrainConfig, description="Optimisation and checkpoint settings."
    )
    scaling: ScalingConfig = Field(
        default_factory=ScalingConfig, description="Number of workers and their resources."
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig,
        description="Parallel strategy and communication backend.",
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Numeric precision; auto picks bf16 on compute capability >= 8.0, fp16 with a "
        "GradScaler on 7.x, fp32 on CPU.",
    )
    optimizations: OptimizationsConfig = Field(
        default_factory=OptimizationsConfig,
        description="torch.compile and gradient checkpointing.",
    )
    dataloader: DataloaderConfig = Field(
        default_factory=DataloaderConfig, description="Per-worker DataLoader settings."
    )
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig, description="Restarts after failures."
    )
    tune: TuneConfig = Field(
        default_factory=TuneConfig, description="Hyperparameter sweep settings."
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="Experiment tracking and the loss plot."
    )
