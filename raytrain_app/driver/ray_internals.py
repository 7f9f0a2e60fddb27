"""The Ray Train V2 internals raytrain uses, each one optional.

raytrain runs on a range of Ray versions (``pyproject.toml``). Where Ray has no public API
for what raytrain does (start fewer actors, run the controller in the driver, decide
elastic sizes on a fresh view of the nodes, pass the storage's AWS_* variables to Ray
Train's controller), it reaches into Ray Train's internals, found here by name. On a Ray
where one is missing or has moved it is None, and raytrain does without it: the run costs
one more process, an older view of the cluster or a controller that reads the storage with
the cluster's own settings; it never fails for it. tests/unit/driver/test_ray_trainer.py
pins each name on the installed Ray (CI runs it on the oldest and the newest Ray of the
range) and runs the trainer's set-up with every one missing.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


def _optional(module: str, name: str | None = None) -> Any:
    """``module`` (or its attribute ``name``), or None where this Ray has no such thing."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        logger.debug("this Ray has no %s; raytrain does without it", module)
        return None
    return found if name is None else getattr(found, name, None)


_V2 = "ray.train.v2._internal"

# Ray Train's settings module: ENV_VARS_TO_PROPAGATE, what the controller actor gets.
train_constants = _optional(f"{_V2}.constants")
# Default callbacks raytrain leaves out when they have nothing to do.
DatasetsCallback = _optional(f"{_V2}.callbacks.datasets", "DatasetsCallback")
PlacementGroupCleanerCallback = _optional(
    f"{_V2}.callbacks.placement_group_callback", "PlacementGroupCleanerCallback"
)
# Callbacks that record the controller actor's id: with one, the controller stays an actor.
StateManagerCallback = _optional(f"{_V2}.callbacks.state_manager", "StateManagerCallback")
# Scaling policies raytrain refines (no autoscaler requests on an embedded Ray; a fresh
# view of the nodes for elastic runs).
FixedScalingPolicy = _optional(f"{_V2}.execution.scaling_policy.fixed", "FixedScalingPolicy")
ElasticScalingPolicy = _optional(f"{_V2}.execution.scaling_policy.elastic", "ElasticScalingPolicy")
# Ray Train's controller and worker group, run in the driver (driver.controller_in_driver).
TrainController = _optional(f"{_V2}.execution.controller.controller", "TrainController")
WorkerGroup = _optional(f"{_V2}.execution.worker_group.worker_group", "WorkerGroup")
# The clock Ray Train's policies read (patched in Ray's own tests); time.monotonic is it.
time_monotonic = _optional(f"{_V2}.util", "time_monotonic") or time.monotonic
