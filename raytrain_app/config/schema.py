"""The config schema's root: every section of a run, in the order YAML and dumps show them.

These pydantic models are the single source of truth for the YAML keys: the sections live in
``run_sections`` and ``training_sections``, their shared base in ``base``. ``loading`` merges
YAML and ``--set`` overrides on top of them and turns validation errors into one-line messages.
"""

from typing import Literal

from pydantic import Field

from raytrain_app.config.base import _Section
from raytrain_app.config.run_sections import (
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    TrackingConfig,
    TuneConfig,
)
from raytrain_app.config.training_sections import (
    DataloaderConfig,
    DistributedConfig,
    FaultToleranceConfig,
    OptimizationsConfig,
    ScalingConfig,
    TrainConfig,
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
