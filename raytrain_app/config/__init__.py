"""The run configuration: the typed schema, YAML and ``--set`` loading, one-line errors.

Runs in every process (CLI, driver, workers, trials); imports nothing else of raytrain's
but ``errors``.
"""

from raytrain_app.config.loading import (
    BUILTIN_CONFIG,
    BUILTIN_SWEEP,
    config_from_dict,
    config_to_dict,
    config_with_values,
    diff_configs,
    dump_config_yaml,
    flatten,
    load_config,
    save_config,
)
from raytrain_app.config.schema import (
    ConfigError,
    DataConfig,
    DataloaderConfig,
    DistributedConfig,
    ExperimentConfig,
    FaultToleranceConfig,
    ModelConfig,
    RaytrainConfig,
    ScalingConfig,
    TrainConfig,
    TuneConfig,
)

__all__ = [
    "BUILTIN_CONFIG",
    "BUILTIN_SWEEP",
    "ConfigError",
    "DataConfig",
    "DataloaderConfig",
    "DistributedConfig",
    "ExperimentConfig",
    "FaultToleranceConfig",
    "ModelConfig",
    "RaytrainConfig",
    "ScalingConfig",
    "TrainConfig",
    "TuneConfig",
    "config_from_dict",
    "config_to_dict",
    "config_with_values",
    "diff_configs",
    "dump_config_yaml",
    "flatten",
    "load_config",
    "save_config",
]
