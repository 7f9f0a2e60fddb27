"""The TorchTrainer raytrain runs: what it leaves out of Ray's, and only that.

These hooks are Ray Train V2 internals (``driver/ray_internals.py``); a Ray that renames one
would silently bring back what it removes, so the names are pinned here, on every Ray that
CI installs (the newest and the oldest of the declared range). On a Ray without them the
trainer keeps Ray's defaults and runs. tests/distributed runs the trainer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import ray.train
from ray.train.torch import TorchTrainer

from raytrain_app.driver import ray_internals
from raytrain_app.driver import trainer as trainer_module
from raytrain_app.driver.ray_internals import (
    DatasetsCallback,
    ElasticScalingPolicy,
    FixedScalingPolicy,
    PlacementGroupCleanerCallback,
)
from raytrain_app.driver.trainer import (
    RaytrainTorchTrainer,
    _ElasticScalingOnCurrentNodes,
    _FixedScalingWithoutAutoscaler,
)

INTERNALS = (
    "train_constants",
    "DatasetsCallback",
    "PlacementGroupCleanerCallback",
    "StateManagerCallback",
    "FixedScalingPolicy",
    "ElasticScalingPolicy",
    "TrainController",
    "WorkerGroup",
)


def _noop(config):
    return None


def _trainer(embedded_ray: bool, **kwargs) -> RaytrainTorchTrainer:
    return RaytrainTorchTrainer(
        _noop,
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        embedded_ray=embedded_ray,
        **kwargs,
    )


def _callback_types(trainer: TorchTrainer) -> set[type]:
    return {type(cb) for cb in trainer._create_default_callbacks()}


def test_every_internal_raytrain_uses_is_in_this_ray():
    for name in INTERNALS:
        assert getattr(ray_internals, name) is not None, f"this Ray has no {name}"
    assert isinstance(ray_internals.train_constants.ENV_VARS_TO_PROPAGATE, set)
    for hook in ("_get_reserved_resources", "GET_RESERVED_RESOURCES_INTERVAL_S"):
        assert hasattr(ElasticScalingPolicy, hook), hook


def test_rays_own_ctrl_c_handler_is_replaced():
    # Ray's handler aborts the run without a checkpoint and exits the process.
    assert callable(TorchTrainer._register_sigint_handler)
    assert (
        RaytrainTorchTrainer._register_sigint_handler is not TorchTrainer._register_sigint_handler
    )


def test_rays_trainer_has_the_callbacks_and_policy_raytrain_removes():
    plain = TorchTrainer(_noop, scaling_config=ray.train.ScalingConfig(num_workers=2))
    assert {DatasetsCallback, PlacementGroupCleanerCallback} <= _callback_types(plain)
    assert callable(TorchTrainer._initialize_and_run_controller)
    for hook in ("after_controller_start", "_maybe_send_resource_request"):
        assert callable(getattr(FixedScalingPolicy, hook))


@pytest.mark.parametrize("embedded_ray", [False, True])
def test_without_datasets_no_dataset_manager_and_on_an_embedded_ray_no_cleaner(embedded_ray):
    kept = _callback_types(_trainer(embedded_ray))
    assert DatasetsCallback not in kept
    assert (PlacementGroupCleanerCallback in kept) is not embedded_ray
    plain = _callback_types(TorchTrainer(_noop, scaling_config=ray.train.ScalingConfig()))
    # Everything else Ray adds (backend and accelerator set-up, user callbacks) stays.
    assert plain - kept == {DatasetsCallback} | (
        {PlacementGroupCleanerCallback} if embedded_ray else set()
    )


def test_the_embedded_scaling_policy_never_asks_an_autoscaler():
    policy = _FixedScalingWithoutAutoscaler(ray.train.ScalingConfig(num_workers=2))
    policy.after_controller_start(train_run_context=None)
    policy._maybe_send_resource_request()
    policy._cancel_resource_request()
    assert policy._coordinator_client is None  # nothing created, nothing sent
    decision = policy.make_decision_for_non_running_worker_group()
    assert decision.num_workers == 2


@pytest.mark.parametrize(
    ("node", "started_here"),
    [
        (None, False),  # no Ray in this process
        (SimpleNamespace(head=False), False),  # connected to a cluster by its address
        (SimpleNamespace(head=True), True),  # ray.init() started a head here
    ],
)
def test_only_a_head_this_process_started_counts_as_started_here(monkeypatch, node, started_here):
    from raytrain_app.driver.embedded_ray import ray_started_here

    # Independent of any Ray an earlier test left running in this process.
    monkeypatch.setattr(ray._private.worker, "_global_node", node)
    assert ray_started_here() is started_here


class _Captured(Exception):
    """Raised by the stand-in for Ray's controller start, carrying what it was given."""


@pytest.fixture
def controller_start(monkeypatch):
    """Ray's controller start (an actor) and raytrain's (in the driver) replaced by ones
    that record where the controller would run, its arguments and the variables an actor
    would get, instead of running anything."""

    def recorder(where: str):
        def start(*args, **kwargs):
            kwargs = args[-1] if where == "driver" else kwargs
            propagated = getattr(ray_internals.train_constants, "ENV_VARS_TO_PROPAGATE", set())
            raise _Captured(where, kwargs, set(propagated))

        return start

    monkeypatch.setattr(TorchTrainer, "_initialize_and_run_controller", recorder("actor"))
    monkeypatch.setattr(trainer_module, "run_controller_in_driver", recorder("driver"))


def _started_with(
    trainer: RaytrainTorchTrainer, policy, callbacks: list | None = None
) -> tuple[str, object, set[str]]:
    with pytest.raises(_Captured) as captured:
        trainer._initialize_and_run_controller(scaling_policy=policy, callbacks=callbacks or [])
    where, kwargs, propagated = captured.value.args
    return where, kwargs["scaling_policy"], propagated


def test_the_controller_gets_raytrains_policies_and_the_storage_variables(controller_start):
    fixed = FixedScalingPolicy(ray.train.ScalingConfig(num_workers=2))
    storage_env = {"AWS_ENDPOINT_URL": "http://s3.example:9000"}  # planning.store_variables'
    _, policy, propagated = _started_with(_trainer(True, storage_env=storage_env), fixed)
    assert type(policy) is _FixedScalingWithoutAutoscaler and "AWS_ENDPOINT_URL" in propagated
    elastic = ElasticScalingPolicy(ray.train.ScalingConfig(num_workers=(1, 2)))
    _, policy, _ = _started_with(_trainer(embedded_ray=False), elastic)
    assert type(policy) is _ElasticScalingOnCurrentNodes
    # Lent for the start only: Ray's own set is as it was.
    assert "AWS_ENDPOINT_URL" not in ray_internals.train_constants.ENV_VARS_TO_PROPAGATE


def test_what_the_workers_of_raytrains_embedded_ray_inherit_is_not_passed_on_again(
    controller_start, monkeypatch
):
    # A runtime env starts each worker through a second Python process that imports Ray.
    store = {"AWS_ENDPOINT_URL": "http://s3.example:9000"}
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    monkeypatch.setenv("AWS_ENDPOINT_URL", store["AWS_ENDPOINT_URL"])
    inherited = {"RAY_worker_niceness": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **store}

    def inherited_by_ray_workers(variables):  # as embedded_ray's for that Ray
        return {name for name, value in variables.items() if inherited.get(name) == value}

    monkeypatch.setattr(trainer_module, "inherited_by_ray_workers", inherited_by_ray_workers)
    fixed = FixedScalingPolicy(ray.train.ScalingConfig(num_workers=2))
    _, _, propagated = _started_with(_trainer(True, storage_env=store), fixed)
    assert not {"RAY_TRAIN_ENABLE_PRINT_PATCH", "AWS_ENDPOINT_URL"} & propagated
    # Lent for the start only: Ray's own set is as it was.
    assert "RAY_TRAIN_ENABLE_PRINT_PATCH" in ray_internals.train_constants.ENV_VARS_TO_PROPAGATE
    runtime_env = trainer_module._worker_runtime_env
    assert runtime_env({"RAY_worker_niceness": "0", **store}) == {}
    assert runtime_env({"RAY_worker_niceness": "10", **store}) == {
        "env_vars": {"RAY_worker_niceness": "10"}  # the user's, set after that Ray started
    }


def _started_where(trainer: RaytrainTorchTrainer, callbacks: list) -> tuple[str, set[type]]:
    """Where the controller of a run with ``callbacks`` starts, and the callback types it
    gets there."""
    fixed = FixedScalingPolicy(ray.train.ScalingConfig(num_workers=2))
    with pytest.raises(_Captured) as captured:
        trainer._initialize_and_run_controller(scaling_policy=fixed, callbacks=callbacks)
    where, kwargs, _ = captured.value.args
    return where, {type(cb) for cb in kwargs["callbacks"]}


def test_the_controller_runs_in_the_driver_unless_through_ray_client_or_it_needs_an_actor_id(
    controller_start, monkeypatch
):
    def bare(cls):  # an instance, its constructor not run (it starts nothing then either)
        return cls.__new__(cls)

    cleaner, tracking = (
        bare(ray_internals.PlacementGroupCleanerCallback),
        bare(ray_internals.StateManagerCallback),
    )
    # On a cluster it joined as a driver (Ray's callbacks keep the cleaner there): in the
    # driver, without the cleaner, which watches a controller actor there is none of.
    assert _started_where(_trainer(embedded_ray=False), [cleaner]) == ("driver", set())
    assert _started_where(_trainer(embedded_ray=True), [])[0] == "driver"
    # Ray Train's state tracking records the controller's actor id: it keeps the actor,
    # and the actor its cleaner.
    where, kept = _started_where(_trainer(embedded_ray=False), [cleaner, tracking])
    assert where == "actor" and type(cleaner) in kept
    # A Ray Client driver runs off the cluster: Ray's controller actor, on the cluster.
    monkeypatch.setattr(trainer_module, "through_ray_client", lambda: True)
    assert _started_where(_trainer(embedded_ray=False), [cleaner]) == ("actor", {type(cleaner)})


def test_on_a_ray_without_the_internals_the_trainer_keeps_rays_defaults(
    monkeypatch, controller_start
):
    """What a Ray that moved every internal raytrain uses gets: Ray's own callbacks and
    policies, passed through untouched; the trainer is built and started all the same."""
    fixed = FixedScalingPolicy(ray.train.ScalingConfig(num_workers=2))
    defaults = _callback_types(TorchTrainer(_noop, scaling_config=ray.train.ScalingConfig()))
    for name in INTERNALS:
        monkeypatch.setattr(ray_internals, name, None)
    trainer = _trainer(embedded_ray=True)
    assert _callback_types(trainer) == defaults
    where, policy, propagated = _started_with(trainer, fixed)
    assert where == "actor" and policy is fixed and propagated == set()


def test_a_missing_internal_module_reads_as_none():
    assert ray_internals._optional("ray.train.v2._internal.no_such_module") is None
    assert ray_internals._optional("ray.train.v2._internal.constants", "NO_SUCH_NAME") is None
