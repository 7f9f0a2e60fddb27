"""The TorchTrainer raytrain runs: what it leaves out of Ray's, and only that.

These hooks are Ray Train V2 internals; a Ray upgrade that renames one would silently bring
back what it removes, so the names are pinned here. tests/distributed runs the trainer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import ray.train
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

from raytrain_app.driver.trainer import RaytrainTorchTrainer, _FixedScalingWithoutAutoscaler


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
    from raytrain_app.driver.ray_connection import ray_started_here

    # Independent of any Ray an earlier test left running in this process.
    monkeypatch.setattr(ray._private.worker, "_global_node", node)
    assert ray_started_here() is started_here
