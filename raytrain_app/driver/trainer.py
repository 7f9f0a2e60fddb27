"""The TorchTrainer raytrain runs, configured from the plan: Ray's, less what raytrain does
itself or cannot use.

- Ray's Ctrl-C handler aborts the run without a checkpoint and exits the process;
  ``driver.signals.stop_on_signals`` checkpoints at the next step and stops instead.
- Without Ray Datasets (raytrain's workers read through their own DataLoaders), Ray Train
  would still start a DatasetManager actor and send every worker Ray Data's context; with
  a data factory's Ray Datasets (``driver.ray_datasets``) it does both, as it must.
- Ray Train's controller runs in this process rather than as an actor
  (``driver.controller_in_driver``), except through Ray Client or with Ray Train's state
  tracking. With it, no placement group can outlive the driver (Ray removes a job's groups
  when its driver ends), so the placement-group-cleaner actor is not started.
- On a Ray this process started (``ray.init()`` without an address: it ends with this
  process) there is no autoscaler to ask for resources and no placement group can outlive
  the driver, so the autoscaling-coordinator and placement-group-cleaner actors are not
  started either, wherever the controller runs.

Each is one more process that starts and imports Ray before the first step, and two of
them kept polling during training (benchmarks/README.md has the cost). These are Ray
Train V2 internals (``ray_internals``): on a Ray without one, raytrain keeps Ray's default
there; tests/distributed checks the trainer still runs, restarts and stops with them
left out.

An elastic run (``scaling.num_workers: [min, max]``) also decides each size on the
cluster's current nodes rather than on a view up to 20 s old (tests/cluster/test_elastic.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain_app.checkpoint.ranking import checkpoint_retention
from raytrain_app.config import RaytrainConfig
from raytrain_app.driver import ray_internals as internals
from raytrain_app.driver.controller_in_driver import (
    callbacks_for_the_driver,
    controller_can_run_here,
    run_controller_in_driver,
    runs_here,
)
from raytrain_app.driver.embedded_ray import inherited_by_ray_workers
from raytrain_app.driver.run_control import DriverControl
from raytrain_app.driver.signals import stop_on_signals
from raytrain_app.planning.cluster_resources import through_ray_client
from raytrain_app.planning.environment import training_worker_env_vars, variables_set
from raytrain_app.planning.store_variables import storage_env_vars
from raytrain_app.startup_gc import PauseOnArrival
from raytrain_app.storage import StorageLocation
from raytrain_app.worker.loop import WorkerTask, train_worker

# How long a decision waits for the coordinator's recomputed view (Ray's own query: 5 s).
_COORDINATOR_TIMEOUT_S = 5.0


class RaytrainTorchTrainer(TorchTrainer):
    """``TorchTrainer`` without Ray's Ctrl-C handler and the actors raytrain has no use for.

    Args:
        embedded_ray: this process started the Ray it runs on (``embedded_ray.ray_started_here``).
        storage_env: the variables the run's stores need (``storage_env_vars``), which
            Ray Train's controller gets too.
    """

    def __init__(
        self,
        *args: Any,
        embedded_ray: bool = False,
        storage_env: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        self._embedded_ray = embedded_ray
        self._storage_env = storage_env or {}
        # A Ray Client's driver runs elsewhere than the cluster's processes: there the
        # controller stays Ray's actor, on the cluster.
        self._controller_in_driver = controller_can_run_here() and not through_ray_client()
        super().__init__(*args, **kwargs)

    def _register_sigint_handler(self, controller: Any) -> None:
        return None

    def _create_default_callbacks(self) -> list:
        unused: tuple[type, ...] = ()
        if not self.datasets and internals.DatasetsCallback is not None:
            unused += (internals.DatasetsCallback,)
        if self._embedded_ray and internals.PlacementGroupCleanerCallback is not None:
            unused += (internals.PlacementGroupCleanerCallback,)
        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unused)]

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        policy = type(controller_init_kwargs.get("scaling_policy"))
        if self._embedded_ray and _is(policy, internals.FixedScalingPolicy):
            controller_init_kwargs["scaling_policy"] = _FixedScalingWithoutAutoscaler(
                self.scaling_config
            )
        if _is(policy, internals.ElasticScalingPolicy):
            controller_init_kwargs["scaling_policy"] = _ElasticScalingOnCurrentNodes(
                self.scaling_config
            )
        # The controller reads and writes the run's storage too (Ray's validation file, its
        # checkpoint bookkeeping): it gets the stores' variables the way Ray Train passes
        # its own settings to it (the workers get them in worker_runtime_env). Those that
        # the processes of raytrain's embedded Ray inherited are not passed on: a runtime
        # env starts each worker through a second Python process that imports Ray too.
        propagated = getattr(internals.train_constants, "ENV_VARS_TO_PROPAGATE", None)
        saved = set(propagated) if isinstance(propagated, set) else None
        if saved is not None:
            propagated.update(self._storage_env)
            propagated.difference_update(inherited_by_ray_workers(variables_set(propagated)))
        try:
            callbacks = controller_init_kwargs.get("callbacks") or []
            if self._controller_in_driver and runs_here(callbacks):
                controller_init_kwargs["callbacks"] = callbacks_for_the_driver(callbacks)
                return run_controller_in_driver(controller_init_kwargs)
            return super()._initialize_and_run_controller(**controller_init_kwargs)
        finally:
            if saved is not None:
                propagated.clear()
                propagated.update(saved)


def _is(policy: type, ray_policy: type | None) -> bool:
    """Whether ``policy`` is exactly Ray's ``ray_policy`` (never a subclass a user passed),
    where this Ray has that policy."""
    return ray_policy is not None and policy is ray_policy


# Subclasses of Ray's policies where this Ray has them; a stand-in base elsewhere keeps the
# module importable (the classes are then never used: see _initialize_and_run_controller).
_FixedBase: type = internals.FixedScalingPolicy or object
_ElasticBase: type = internals.ElasticScalingPolicy or object


class _FixedScalingWithoutAutoscaler(_FixedBase):
    """Ray's fixed-size policy minus the resource requests to an autoscaler that an
    embedded Ray does not have (each would start Ray Data's coordinator actor)."""

    def after_controller_start(self, train_run_context: Any) -> None:
        return None

    def _maybe_send_resource_request(self) -> None:
        return None

    def _cancel_resource_request(self) -> None:
        return None


class _ElasticScalingOnCurrentNodes(_ElasticBase):
    """Ray's elastic policy, deciding on the cluster as it is now.

    Ray's autoscaling coordinator refreshes its view of the nodes every 20 s. Without a
    fresh look, a restart right after a node was lost plans a worker on the dead node and
    waits out the worker-group start timeout (60 s) before trying again with fewer, and a
    node that joined stays unseen for as long. Each decision (at most one a second while
    restarting, one per scaling.elastic_resize_interval_s while training) asks the
    coordinator to recompute first.
    """

    def _get_reserved_resources(self) -> Any:
        # A failure here (an unreachable coordinator, or a Ray whose policy has other
        # internals) costs only the fresh view: Ray's own query below still runs.
        with contextlib.suppress(Exception):
            since = internals.time_monotonic() - self._latest_reserved_resources_query_time
            if since >= self.GET_RESERVED_RESOURCES_INTERVAL_S:
                ray.get(
                    self._autoscaling_coordinator.get_reserved_resources.remote(
                        self._requester_id, recompute=True
                    ),
                    timeout=_COORDINATOR_TIMEOUT_S,
                )
        return super()._get_reserved_resources()


def run_trainer(
    task: WorkerTask,
    cfg: RaytrainConfig,
    checkpoints: StorageLocation,
    progress: bool,
    embedded_ray: bool,
    datasets: dict[str, Any] | None = None,
    dataset_config: ray.train.DataConfig | None = None,
) -> tuple[ray.train.Result, str | None]:
    """Run the TorchTrainer; returns its result and the stop signal received, if any.

    ``checkpoints`` is where Ray Train keeps the run's checkpoints (the run directory's
    ``checkpoints/``: a local or shared path, or an object store). ``datasets`` and
    ``dataset_config``: a data factory's Ray Datasets (``driver.ray_datasets``), which Ray
    Train splits over the workers; None for raytrain's own loaders.
    """
    plan = task.plan
    storage_env = storage_env_vars(cfg)
    run_config = ray.train.RunConfig(
        name=cfg.experiment.name,
        storage_path=checkpoints.path,
        storage_filesystem=None if checkpoints.is_local else checkpoints.filesystem,
        failure_config=ray.train.FailureConfig(max_failures=cfg.fault_tolerance.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(**checkpoint_retention(cfg.train)),
        # Ray Train's per-report INFO lines would drown raytrain's own epoch lines.
        logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        # Workers on other nodes reach the run's stores with the driver's variables for them.
        worker_runtime_env=_worker_runtime_env({**training_worker_env_vars(), **storage_env}),
    )
    scaling = ray.train.ScalingConfig(
        # (min, max): Ray Train's elastic mode; the workers re-split the batch for the size
        # they get (worker.loop, planning.rules.plan_for_world_size).
        num_workers=plan.worker_range or plan.world_size,
        elastic_resize_monitor_interval_s=cfg.scaling.elastic_resize_interval_s,
        use_gpu=plan.use_gpu,
        resources_per_worker={
            "CPU": plan.cpus_per_worker,
            **({"GPU": plan.gpus_per_worker} if plan.use_gpu else {}),
        },
    )
    with DriverControl(progress) as control, stop_on_signals(control.stop) as received:
        task.control, task.show_progress = control.actor, progress
        trainer = RaytrainTorchTrainer(
            _train_loop_entry,
            # First: its unpickling on a worker pauses the collector before the task
            # brings in torch (startup_gc); the loop resumes it after the first step.
            train_loop_config={"startup": PauseOnArrival(), "task": task},
            torch_config=TorchConfig(backend=plan.backend, timeout_s=plan.timeout_s),
            scaling_config=scaling,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            embedded_ray=embedded_ray,
            storage_env=storage_env,
        )
        result = trainer.fit()
    # The earlier attempts' goodput accounts, beside the last one's (driver.goodput).
    returned = {**(result.return_value or {}), "goodput_attempts": control.accounts}
    return dataclasses.replace(result, return_value=returned), received[0] if received else None


def _worker_runtime_env(variables: dict[str, str]) -> dict[str, Any]:
    """The training workers' runtime env: ``variables`` less those they inherit already
    (raytrain's embedded Ray). Empty, it starts no runtime-env set-up process per worker
    (a second Python process that imports Ray: 0.4-0.6 s of CPU each, on the way to the
    first step; benchmarks/README.md, "First step")."""
    inherited = inherited_by_ray_workers(variables)
    needed = {name: value for name, value in variables.items() if name not in inherited}
    return {"env_vars": needed} if needed else {}


def _train_loop_entry(config: dict[str, Any]) -> dict[str, Any]:
    return train_worker(config["task"])
