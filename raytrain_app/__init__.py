"""raytrain: data-parallel PyTorch training on Ray, from a laptop to a SLURM cluster.

The Python API mirrors the CLI::

    import raytrain_app as rt
    cfg = rt.load_config(overrides=["train.epochs=3"])
    result = rt.train(cfg)
    model = rt.load_model(result.checkpoint)
"""

from __future__ import annotations

import importlib
import time
from typing import TYPE_CHECKING

# First: its import stamps a command's start (run_clock), before the imports that follow.
from raytrain_app import run_clock, startup_gc
from raytrain_app.config import ConfigError, RaytrainConfig, config_from_dict, load_config
from raytrain_app.errors import BadInputError, RunFailedError

if TYPE_CHECKING:
    from raytrain_app.checkpoint.export import export_hf
    from raytrain_app.checkpoint.loading import load_model
    from raytrain_app.protocol import CollatedBatch, DataSplits, ModelSpec, StepOutput

# Names whose modules import torch (1.5 s): imported on first use, so that `raytrain jobs`,
# `raytrain submit` and a job's client never pay for torch they do not use.
_LAZY = {
    "load_model": "raytrain_app.checkpoint.loading",
    "export_hf": "raytrain_app.checkpoint.export",
    "CollatedBatch": "raytrain_app.protocol",
    "DataSplits": "raytrain_app.protocol",
    "ModelSpec": "raytrain_app.protocol",
    "StepOutput": "raytrain_app.protocol",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raytrain_app' has no attribute {name!r}")


__all__ = [
    "BadInputError",
    "CollatedBatch",
    "ConfigError",
    "DataSplits",
    "ModelSpec",
    "RaytrainConfig",
    "RunFailedError",
    "StepOutput",
    "config_from_dict",
    "export_hf",
    "load_config",
    "load_model",
    "plan",
    "submit",
    "train",
    "tune",
]


def train(config=None, *, overrides=(), address=None, progress=True, local=False):
    """Train a config (object, dict, YAML path or None for the quickstart); see driver.train.

    ``local=True``: in this process, without Ray (Ray Train's local mode), for debugging.
    """
    called_at = time.time()  # goodput's start-up counts from here (or the command's start)
    from raytrain_app.driver.run_start import run_begun

    cfg = _as_config(config, overrides)
    # A Ray started for this run starts beside the driver's imports and checks.
    with run_begun(cfg, address, local):
        with startup_gc.paused():  # imports of torch and Ray Train: 0.6 s less CPU
            from raytrain_app.driver.training import train as _train

        return _train(
            cfg,
            address=address,
            progress=progress,
            local=local,
            began_at=run_clock.run_began_at(called_at),
        )


def tune(config=None, *, overrides=(), address=None, trust_code=False):
    """Run the sweep of ``config.tune`` (default: the built-in wind sweep); a TuneResult.

    ``trust_code=True``: resume a sweep whose Tune state is not provably yours (in a
    bucket); Tune unpickles it.
    """
    from raytrain_app.config import BUILTIN_SWEEP
    from raytrain_app.driver.run_start import run_begun

    if config is None:
        cfg = load_config(None, overrides, builtin=BUILTIN_SWEEP)
    else:
        cfg = _as_config(config, overrides)
    # A Ray started for the sweep starts beside the imports of Tune and torch.
    with run_begun(cfg, address, local=False, command="tune"):
        with startup_gc.paused():  # imports of torch, Ray Train and Tune
            from raytrain_app.sweep.tuning import tune_sweep

        return tune_sweep(cfg, address=address, trust_code=trust_code)


def submit(command, *, address=None, working_dir=".", wait=True, env_vars=()):
    """Submit ``raytrain <command>`` as a Ray job; see raytrain_app.jobs.submit.

    ``env_vars``: names of this process's environment variables the job gets (nothing
    else of it goes along but S3 credentials, when the run or its data is in S3).
    """
    from raytrain_app.jobs import submit as _submit

    return _submit(command, address=address, working_dir=working_dir, wait=wait, env_vars=env_vars)


def plan(config=None, *, overrides=(), address=None):
    """The resolved TrainingPlan of a config, without starting any training."""
    from raytrain_app.driver.ray_connection import connected_plan

    return connected_plan(_as_config(config, overrides), address)[1]


def _as_config(config, overrides) -> RaytrainConfig:
    if isinstance(config, RaytrainConfig):
        return config_from_dict(config.model_dump(), overrides) if overrides else config
    if isinstance(config, dict):
        return config_from_dict(config, overrides)
    return load_config(config, overrides)
