"""The sections naming what a run is: experiment, model and data, its sweep and its tracking."""

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from raytrain_app.config.base import (
    NonEmptyStr,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    _Section,
)

_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


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
    streaming: Literal["auto"] | bool = Field(
        "auto",
        description="Stream Parquet data (data.path, synthetic_wind) through a prepare pass on "
        "Ray Data instead of loading it into every worker; auto: stream when the Parquet "
        "files hold more than 1 GiB.",
    )
    preprocess_resources: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Ray custom resources every preprocessing task of streaming data asks "
        "for, so that it runs only on the nodes offering them (e.g. CPU-only nodes started "
        "with --resources='{\"data_prep\": 64}' and {data_prep: 1} here); empty: any node.",
    )
    cache_dir: NonEmptyStr | None = Field(
        None,
        description="Folder (a shared path or a URI every node sees) for prepared streaming "
        "data, reused by any run with the same files and window params; null: the run "
        "directory's data/.",
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
        description="MLflow tracking URI (a server or a database), without credentials: "
        "MLflow reads a server's from MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
        "(or MLFLOW_TRACKING_TOKEN), which go to the workers too; null: the file store in the "
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
