"""``ray_connection.ray_session`` decides how Ray starts; ``ray.init`` is replaced, no Ray runs."""

from __future__ import annotations

import os

import pytest

from raytrain_app.driver import ray_connection
from raytrain_app.planning.environment import Resources, detect_environment


@pytest.fixture
def init_calls(monkeypatch) -> list[dict]:
    """Every ``ray.init`` call's keyword arguments; Ray itself never starts."""
    calls: list[dict] = []
    monkeypatch.setattr(ray_connection.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_connection.ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray_connection.ray, "shutdown", lambda: None)
    cluster = Resources(cpus=2.0, gpus=0.0, nodes=1, source="ray cluster")
    monkeypatch.setattr(ray_connection, "ray_cluster_resources", lambda: (cluster, None))
    return calls


@pytest.mark.parametrize(
    ("variables", "host"),
    [({}, "127.0.0.1"), ({"RAYTRAIN_DASHBOARD_HOST": "0.0.0.0"}, "0.0.0.0")],
)
def test_an_embedded_ray_binds_its_dashboard_to_localhost_unless_opted_in(
    init_calls, variables, host
):
    with ray_connection.ray_session(None, detect_environment(variables)) as env:
        assert env.resources.source == "this machine"
    (call,) = init_calls
    assert call["dashboard_host"] == host and "address" not in call


def test_connecting_to_a_cluster_starts_no_dashboard(init_calls):
    with ray_connection.ray_session("10.0.0.1:6379", detect_environment({})):
        pass
    (call,) = init_calls
    assert call["address"] == "10.0.0.1:6379" and "dashboard_host" not in call


def test_an_embedded_ray_turns_off_cluster_only_ray_train_features_while_it_runs(
    init_calls, monkeypatch
):
    monkeypatch.setattr(os, "environ", {})  # an empty environment, restored afterwards
    names = ("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "RAY_TRAIN_METRICS_ENABLED")
    with ray_connection.ray_session(None, detect_environment({})):
        assert all(os.environ[name] == "0" for name in names)
    # Gone again: a later session in this process may connect to a cluster.
    assert not any(name in os.environ for name in names)
    with ray_connection.ray_session("10.0.0.1:6379", detect_environment({})):
        assert not any(name in os.environ for name in names)
