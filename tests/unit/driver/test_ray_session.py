"""``ray_connection.ray_session`` decides how Ray starts; ``ray.init`` is replaced, no Ray runs."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from ray._private import ray_constants, services
from ray._private.node import Node

from raytrain_app.driver import embedded_ray, ray_connection
from raytrain_app.planning.environment import Resources, detect_environment

_RAYS_DASHBOARD_START = Node.start_api_server
_RAYS_NODE_LOOKUP = services.get_node


@pytest.fixture
def home(monkeypatch, tmp_path) -> Path:
    """A HOME of the test's own (where Ray's token file goes), with no Ray token given."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in [name for name in os.environ if name.startswith("RAY_AUTH_")]:
        monkeypatch.delenv(name)
    return tmp_path


@pytest.fixture
def init_calls(monkeypatch, home) -> list[dict]:
    """Every ``ray.init`` call's keyword arguments, with what Ray would see then: whether it
    would keep a loopback node address (``ENABLE_RAY_CLUSTER`` off), the mode of the token
    file, how its node would start its dashboard and how it would look its raylet up. Ray
    itself never starts."""
    calls: list[dict] = []

    def init(**kwargs) -> None:
        token = home / ".ray" / "auth_token"
        kwargs["_seen"] = {
            "enable_ray_cluster": ray_constants.ENABLE_RAY_CLUSTER,
            "token_mode": stat.S_IMODE(token.stat().st_mode) if token.exists() else None,
            "dashboard_start": getattr(Node, "start_api_server", None),
            "node_lookup": getattr(services, "get_node", None),
        }
        calls.append(kwargs)

    monkeypatch.setattr(ray_connection.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_connection.ray, "init", init)
    monkeypatch.setattr(ray_connection.ray, "shutdown", lambda: None)
    cluster = Resources(cpus=2.0, gpus=0.0, nodes=1, source="ray cluster")
    monkeypatch.setattr(ray_connection, "ray_cluster_resources", lambda: (cluster, None))
    return calls


@pytest.mark.parametrize(
    ("variables", "ui", "host"),
    [
        ({}, False, "127.0.0.1"),
        ({"RAYTRAIN_DASHBOARD_HOST": "127.0.0.1"}, True, "127.0.0.1"),
        ({"RAYTRAIN_DASHBOARD_HOST": "0.0.0.0"}, True, "0.0.0.0"),
    ],
)
def test_an_embedded_ray_has_a_dashboard_ui_only_where_asked_and_binds_localhost_unless_told(
    init_calls, variables, ui, host
):
    # Without the UI Ray's dashboard process (which would then serve nothing, and which
    # ray.init() waits for) is not started at all; with it, it binds to dashboard_host.
    with ray_connection.ray_session(None, detect_environment(variables)) as env:
        assert env.resources.source == "this machine"
    (call,) = init_calls
    assert call["include_dashboard"] is ui and call["dashboard_host"] == host
    assert (call["_seen"]["dashboard_start"] is _RAYS_DASHBOARD_START) is ui
    assert "address" not in call
    assert Node.start_api_server is _RAYS_DASHBOARD_START  # Ray's own again afterwards


def test_a_ray_without_the_dashboards_start_method_starts_its_dashboard_as_usual(
    init_calls, monkeypatch
):
    # Another Ray version, whose Node starts its dashboard some other way: nothing is
    # replaced, and ray.init() starts what that Ray starts.
    monkeypatch.delattr(Node, "start_api_server")
    with ray_connection.ray_session(None, detect_environment({})):
        pass
    (call,) = init_calls
    assert call["include_dashboard"] is False and call["_seen"]["dashboard_start"] is None
    assert not hasattr(Node, "start_api_server")


def test_an_embedded_ray_looks_its_raylet_up_once_registered_and_rays_lookup_is_back_after(
    init_calls,
):
    # Ray's lookup polls the GCS once a second; during the embedded start it runs after
    # raytrain's 20 ms wait for the registration (driver.raylet_registration).
    with ray_connection.ray_session(None, detect_environment({})):
        pass
    (call,) = init_calls
    lookup = call["_seen"]["node_lookup"]
    assert lookup is not _RAYS_NODE_LOOKUP and lookup.__wrapped__ is _RAYS_NODE_LOOKUP
    assert services.get_node is _RAYS_NODE_LOOKUP


def test_a_ray_without_the_node_lookup_starts_as_ray_starts_it(init_calls, monkeypatch):
    monkeypatch.delattr(services, "get_node")
    with ray_connection.ray_session(None, detect_environment({})):
        pass
    (call,) = init_calls
    assert call["_seen"]["node_lookup"] is None and not hasattr(services, "get_node")


def test_connecting_to_a_cluster_starts_no_dashboard(init_calls):
    with ray_connection.ray_session("10.0.0.1:6379", detect_environment({})):
        pass
    (call,) = init_calls
    assert call["address"] == "10.0.0.1:6379"
    assert "dashboard_host" not in call and "include_dashboard" not in call
    assert call["_seen"]["node_lookup"] is _RAYS_NODE_LOOKUP  # Ray's own: no Ray starts here


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


def test_the_workers_of_an_embedded_ray_inherit_its_defaults_set_before_it_starts(
    init_calls, monkeypatch
):
    monkeypatch.setattr(os, "environ", {"AWS_ENDPOINT_URL": "http://s3.example:9000"})
    monkeypatch.setattr(embedded_ray, "ray_started_here", lambda: True)
    seen: dict[str, str] = {}
    monkeypatch.setattr(ray_connection.ray, "init", lambda **kwargs: seen.update(os.environ))
    wanted = {
        "RAY_worker_niceness": "0",  # a training worker's nice value
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        "AWS_ENDPOINT_URL": "http://s3.example:9000",  # a store's, the user's own
    }
    with ray_connection.ray_session(None, detect_environment({})):
        # In the environment the Ray's processes inherit: nothing to pass on again.
        assert all(seen[name] == value for name, value in wanted.items())
        assert embedded_ray.inherited_by_ray_workers(wanted) == set(wanted)
        os.environ["AWS_ENDPOINT_URL"] = "http://elsewhere:9000"  # set after the start
        moved = {"AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]}
        assert embedded_ray.inherited_by_ray_workers(moved) == set()
    assert embedded_ray.inherited_by_ray_workers(wanted) == set()  # that Ray is gone
    assert "RAY_worker_niceness" not in os.environ  # nor its defaults
    with ray_connection.ray_session("10.0.0.1:6379", detect_environment({})):
        # A cluster's workers inherit nothing from this process.
        assert embedded_ray.inherited_by_ray_workers(wanted) == set()


# ------------------------------------------------------------ what an embedded Ray exposes
# Issue 29: the embedded Ray's ports listened on every interface and its token file was
# world-readable. The real Ray's sockets and file: tests/distributed/test_embedded_ray.py.


def test_an_embedded_ray_starts_on_loopback_only(init_calls):
    with ray_connection.ray_session(None, detect_environment({})):
        pass
    (call,) = init_calls
    # Ray keeps a loopback node address (and so binds to it) only with this off.
    assert call["_node_ip_address"] == "127.0.0.1"
    assert call["_seen"]["enable_ray_cluster"] is False
    assert ray_constants.ENABLE_RAY_CLUSTER is True  # as it was, once started


def test_connecting_to_a_cluster_leaves_its_addresses_alone(init_calls, home):
    with ray_connection.ray_session("10.0.0.1:6379", detect_environment({})):
        pass
    (call,) = init_calls
    assert "_node_ip_address" not in call and call["_seen"]["enable_ray_cluster"] is True
    assert not (home / ".ray").exists()  # and makes no token


def test_the_token_an_embedded_ray_generates_is_private_from_the_start(init_calls, home):
    with ray_connection.ray_session(None, detect_environment({})):
        pass
    (call,) = init_calls
    assert call["_seen"]["token_mode"] == 0o600  # there before Ray looks for one
    token = home / ".ray" / "auth_token"
    assert len(token.read_text()) == 64 and int(token.read_text(), 16) >= 0
    assert stat.S_IMODE((home / ".ray").stat().st_mode) == 0o700


@pytest.mark.parametrize(
    "given",
    [{"RAY_AUTH_TOKEN": "a" * 64}, {"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_TOKEN_PATH": "/x"}],
    ids=["token", "auth_off", "token_path"],
)
def test_no_token_file_is_made_when_ray_would_not_make_one(init_calls, home, monkeypatch, given):
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    with ray_connection.ray_session(None, detect_environment({})):
        pass
    assert not (home / ".ray" / "auth_token").exists()


def test_a_readable_token_file_of_the_users_is_left_alone_with_a_warning(init_calls, home, caplog):
    token = home / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("b" * 64)
    token.chmod(0o644)
    env = detect_environment({})
    with (
        caplog.at_level(logging.WARNING, logger=embedded_ray.__name__),
        ray_connection.ray_session(None, env),
    ):
        pass
    assert token.read_text() == "b" * 64 and stat.S_IMODE(token.stat().st_mode) == 0o644
    (warning,) = [r.getMessage() for r in caplog.records if r.name == embedded_ray.__name__]
    assert "readable by other users" in warning and f"chmod 600 {token}" in warning
