"""The TorchTrainer raytrain runs: Ray's, less what raytrain does itself or cannot use.

- Ray's Ctrl-C handler aborts the run without a checkpoint and exits the process;
  ``driver.stop_on_signals`` checkpoints at the next step and stops instead.
- Without Ray Datasets (raytrain's workers read through their own DataLoaders), Ray Train
  would still start a DatasetManager actor and send every worker Ray Data's context.
- On a Ray this process started (``ray.init()`` without an address: it ends with this
  process) there is no autoscaler to ask for resources and no placement group can outlive
  the driver, so the autoscaling-coordinator and placement-group-cleaner actors are not
  started.

Each is one more process that starts and imports Ray before the first step, and two of
them kept polling during training (1-2 % of a core on a 2-core machine). These are Ray
Train V2 internals of the pinned Ray (2.60); tests/distributed checks the
trainer still runs, restarts and stops with them left out.
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy


class RaytrainTorchTrainer(TorchTrainer):
    """``TorchTrainer`` without Ray's Ctrl-C handler and the actors raytrain has no use for.

    Args:
        embedded_ray: this process started the Ray it runs on (``driver.ray_started_here``).
    """

    def __init__(self, *args: Any, embedded_ray: bool = False, **kwargs: Any) -> None:
        self._embedded_ray = embedded_ray
        super().__init__(*args, **kwargs)

    def _register_sigint_handler(self, controller: Any) -> None:
        return None

    def _create_default_callbacks(self) -> list:
        unused: tuple[type, ...] = ()
        if not self.datasets:
            unused += (DatasetsCallback,)
        if self._embedded_ray:
            unused += (PlacementGroupCleanerCallback,)
        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unused)]

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        policy = controller_init_kwargs.get("scaling_policy")
        if self._embedded_ray and type(policy) is FixedScalingPolicy:
            controller_init_kwargs["scaling_policy"] = _FixedScalingWithoutAutoscaler(
                self.scaling_config
            )
        return super()._initialize_and_run_controller(**controller_init_kwargs)


class _FixedScalingWithoutAutoscaler(FixedScalingPolicy):
    """Ray's fixed-size policy minus the resource requests to an autoscaler that an
    embedded Ray does not have (each would start Ray Data's coordinator actor)."""

    def after_controller_start(self, train_run_context: Any) -> None:
        return None

    def _maybe_send_resource_request(self) -> None:
        return None

    def _cancel_resource_request(self) -> None:
        return None
