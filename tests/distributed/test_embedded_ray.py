"""The Ray that raytrain starts itself (no cluster given) is this user's alone: every port of
every one of its processes listens on loopback, and its token file is readable by its owner
only. Issue 29: the ports listened on every interface, the token file was 0644. Its workers
run at nice 0 with raytrain's Ray Train settings, inherited from the driver, it runs no
dashboard process unless its UI is asked for, its metrics endpoint served all the same,
and ray.init() finds its raylet as soon as it registers (issue 38).

The embedded Ray runs in a subprocess (this process holds the session's Ray), with its own
HOME and temp dir; the unit side is tests/unit/driver/test_ray_session.py and
test_ray_beside.py."""

from __future__ import annotations

import ipaddress
import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_app.testing.isolation import isolated_env

pytestmark = pytest.mark.distributed

# raytrain's own session start, as `raytrain train` makes it (begun in a background thread,
# then taken over), a task (so a worker process listens too), then every listening socket
# of this process and all it started.
_PROBE = """
import json, os, time, urllib.request
import psutil, ray
from ray.util.metrics import Gauge
from raytrain_app.driver import raylet_registration
from raytrain_app.driver.embedded_ray import inherited_by_ray_workers
from raytrain_app.driver.ray_connection import embedded_ray_beside, ray_session
from raytrain_app.planning.environment import detect_environment, training_worker_env_vars

def listening(process):
    connections = getattr(process, "net_connections", None) or process.connections
    return [c for c in connections(kind="inet") if c.status == psutil.CONN_LISTEN]

@ray.remote
def worker_view():
    names = ("RAY_TRAIN_ENABLE_PRINT_PATCH", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    Gauge("raytrain_probe", description="set by the probe").set(1.0)
    time.sleep(1.5)  # past the core worker's next metrics report (RAY_metrics_report_interval_ms)
    return os.getpid(), os.nice(0), {name: os.environ.get(name) for name in names}

def scraped(port):  # whether the node's Prometheus endpoint shows the gauge (within 30 s)
    for _ in range(60):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        except OSError:
            text = b""
        if b"ray_raytrain_probe" in text:
            return True
        time.sleep(0.5)
    return False

# What ray.init()'s fine wait for the raylet's registration saw: True, the node registered.
registered, rays_wait = [], raylet_registration.wait_until_registered
def recorded_wait(*args, **kwargs):
    registered.append(rays_wait(*args, **kwargs))
    return registered[-1]
raylet_registration.wait_until_registered = recorded_wait

with embedded_ray_beside(), ray_session(None, detect_environment()):
    worker_pid, nice, variables = ray.get(worker_view.remote())
    inherited = sorted(inherited_by_ray_workers(training_worker_env_vars()))
    metrics = scraped(ray._private.worker._global_node.metrics_export_port)
    me = psutil.Process()
    found, started = [], []
    for process in [me, *me.children(recursive=True)]:
        try:
            sockets = listening(process)
            started.append(" ".join(process.cmdline()))
        except psutil.Error:
            continue
        found += [[process.name(), process.pid, s.laddr.ip, s.laddr.port] for s in sockets]
print(json.dumps({
    "listening": found, "worker_pid": worker_pid, "nice": nice, "variables": variables,
    "inherited": inherited, "metrics": metrics, "started": started, "registered": registered,
}))
"""


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def test_an_embedded_ray_is_this_users_alone_and_its_workers_inherit_raytrains_settings(
    tmp_path, ray_tmp
):
    home = tmp_path / "home"
    env = isolated_env(home, RAY_TMPDIR=ray_tmp, RAY_metrics_report_interval_ms="500")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    listening = probe["listening"]
    names = {name for name, *_ in listening}
    # The check sees Ray's servers: the GCS, the raylet and a worker's own gRPC server.
    assert {"gcs_server", "raylet"} <= names, listening
    assert probe["worker_pid"] in {pid for _, pid, *_ in listening}, listening
    assert [entry for entry in listening if not _loopback(entry[2])] == []
    # Its workers run at nice 0 with Ray Train's settings from the start: the training
    # workers need no runtime env, which would start each through a second Python
    # process that imports Ray (driver.trainer._worker_runtime_env).
    assert probe["nice"] == 0 and probe["inherited"] == ["RAY_worker_niceness"]
    assert probe["variables"] == {
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    }
    # No UI asked for: no dashboard process, which would serve nothing and which ray.init()
    # waits for; the dashboard agent still serves the node's metrics (issue 38).
    started = probe["started"]
    assert not [line for line in started if "dashboard/dashboard.py" in line], started
    assert [line for line in started if "dashboard/agent.py" in line], started
    assert probe["metrics"], "the worker's gauge never reached the metrics endpoint"
    # ray.init() found its raylet through raytrain's 20 ms wait for its registration, not
    # at Ray's next one-second poll (driver.raylet_registration).
    assert probe["registered"] == [True]
    token = home / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700


def test_the_test_sessions_own_ray_keeps_its_token_private_too(ray_cluster):
    """The session's Ray (tests/support/ray_sessions.py) starts as the embedded one does: with
    Ray's own 0644 token in the session's HOME, every later embedded start in the same
    process warned about it, a second stderr line that one-line error tests counted."""
    token = Path.home() / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
