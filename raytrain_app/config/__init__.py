"""The run configuration: the typed schema, YAML and ``--set`` loading, one-line errors.

Runs in every process (CLI, driver, workers, trials); imports nothing else of raytrain's
but ``errors`` and ``storage`` (to recognise URIs with credentials in them).
"""

from raytrain_app.config.base import ConfigError
from raytrain_app.config.loading import (
    config_from_dict,
    config_with_values,
    diff_configs,
    flatten,
    load_config,
)
from raytrain_app.config.run_sections import DataConfig, ExperimentConfig, ModelConfig, TuneConfig
from raytrain_app.config.schema import RaytrainConfig
from raytrain_app.config.training_sections import (
    DataloaderConfig,
    DistributedConfig,
    FaultToleranceConfig,
    ScalingConfig,
    TrainConfig,
)
from raytrain_app.config.yaml_io import (
    BUILTIN_CONFIG,
    BUILTIN_SWEEP,
    config_to_dict,
    dump_config_yaml,
    save_config,
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
