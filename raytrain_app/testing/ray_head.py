"""A private Ray head (``ray start --head``): own ports, temp dir, HOME and token; stopped by PID.

``ray stop`` would stop every Ray on the machine, so the head's processes are found by its
temp dir on their command lines and signalled one by one (``processes``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from raytrain_app.testing.isolation import isolated_env, ray_temp_dir
from raytrain_app.testing.ports import free_ports
from raytrain_app.testing.processes import descendants, pids_naming, stop_processes_naming

START_TIMEOUT_S = 180.0  # ``ray start --head`` itself, dashboard modules included
# Ray's dashboard starts each of its nine modules in a subprocess and gives up after 30 s
# (RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT). On a loaded machine, such as CI's
# compatibility tier in the background beside the main suite, importing them took longer.
DASHBOARD_MODULE_TIMEOUT_S = 120.0
JOB_SERVER_TIMEOUT_S = 60.0  # then until the dashboard's job API answers


@dataclass(frozen=True)
class RayHead:
    """A running head node and what a client needs to reach it."""

    gcs_address: str  # 127.0.0.1:PORT, for ``ray.init`` and ``raytrain train --address``
    dashboard_url: str  # http://127.0.0.1:PORT, for the job API
    token: str
    temp_dir: str  # Ray's temp dir; every process of the head names it but one (below)
    home: Path  # the HOMEs of the head ("head") and of its clients ("client")
    # The Ray Client server, the one process that does not name the temp dir. Its own free
    # port: Ray's default, 10001, would be shared by every head on the machine.
    client_server_port: int

    def client_env(self, with_token: bool = True, **set_vars: str) -> dict[str, str]:
        """Environment of a client process: its own HOME and the head's token (or none)."""
        if with_token:
            set_vars = {"RAY_AUTH_TOKEN": self.token, "RAY_AUTH_MODE": "token", **set_vars}
        return isolated_env(self.home / "client", **set_vars)

    def processes(self) -> list[int]:
        """PIDs of this head's processes."""
        return pids_naming(self.temp_dir) + pids_naming(*self._client_server_markers())

    def stop(self) -> None:
        """Stop every process of this head and delete its temp dir."""
        stop_processes_naming(self.temp_dir)
        stop_processes_naming(*self._client_server_markers())
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _client_server_markers(self) -> tuple[str, str]:
        return "ray.util.client.server", f"--port={self.client_server_port}\0"


def start_head(
    root: Path,
    num_cpus: int = 2,
    *,
    pythonpath: str | None = None,
    temp_dir: str | None = None,
    node_death_s: float | None = None,
) -> RayHead:
    """``ray start --head`` with token auth on free ports; returns once the job server answers.

    Args:
        root: a folder of the caller's; the head's and its clients' HOMEs go under it.
        num_cpus: CPUs the head offers.
        pythonpath: PYTHONPATH of the head, which its workers inherit. None (the default):
            none at all, so user code reaches the cluster only with a job, as on a real one.
        temp_dir: Ray's temp dir, made here when None. A caller that must know the head's
            processes from their start (by this marker) makes it first.
        node_death_s: about how long the head takes to declare a silent node dead (Ray's
            default is some 15-30 s of missed health checks); None keeps Ray's.
    """
    ports = free_ports(9)
    gcs, dashboard, client_server = ports[:3]
    token = secrets.token_hex(16)
    head = RayHead(
        gcs_address=f"127.0.0.1:{gcs}",
        dashboard_url=f"http://127.0.0.1:{dashboard}",
        token=token,
        temp_dir=temp_dir or ray_temp_dir("rt-head-"),
        home=root / "home",
        client_server_port=client_server,
    )
    head_vars = _head_variables(token, pythonpath, node_death_s)
    env = isolated_env(head.home / "head", without=("PYTHONPATH",), **head_vars)
    try:
        started = subprocess.run(
            _start_command(ports, num_cpus, head.temp_dir),
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
        if started.returncode != 0:
            raise RuntimeError(
                f"ray start --head failed ({started.returncode}): {started.stderr[-2000:]}"
            )
        _wait_for_job_server(head)
    except BaseException:
        head.stop()  # whatever it started before failing
        raise
    return head


def _head_variables(
    token: str, pythonpath: str | None, node_death_s: float | None
) -> dict[str, str]:
    """The head's environment variables besides isolated_env's."""
    # ray start --head turns token auth on when a token exists; the job server then refuses
    # requests without it. Jobs run `raytrain` on the head: isolated_env puts this venv's
    # scripts first on its PATH.
    head_vars = {
        "RAY_AUTH_TOKEN": token,
        "RAY_AUTH_MODE": "token",
        "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": str(DASHBOARD_MODULE_TIMEOUT_S),
    }
    if pythonpath:
        head_vars["PYTHONPATH"] = pythonpath
    if node_death_s is not None:  # read by the GCS, which ray start launches
        period_ms = max(100, int(node_death_s * 1000 / 3))
        head_vars |= {
            "RAY_health_check_period_ms": str(period_ms),
            "RAY_health_check_timeout_ms": str(period_ms),
            "RAY_health_check_failure_threshold": "3",
        }
    return head_vars


def _start_command(ports: list[int], num_cpus: int, temp_dir: str) -> list[str]:
    (
        gcs,
        dashboard,
        client_server,
        node_manager,
        object_manager,
        agent_listen,
        agent_grpc,
        runtime_env,
        metrics,
    ) = ports
    return [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={temp_dir}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client_server}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--dashboard-agent-listen-port={agent_listen}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        "--disable-usage-stats",
        # Worker ports keep Ray's default range: each worker binds a free one in it.
    ]


def _wait_for_job_server(head: RayHead) -> None:
    """Wait until the dashboard's job API answers an authorised request."""
    deadline = time.monotonic() + JOB_SERVER_TIMEOUT_S
    request = urllib.request.Request(
        f"{head.dashboard_url}/api/jobs/", headers={"Authorization": f"Bearer {head.token}"}
    )
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the job server at {head.dashboard_url} did not answer within "
                    f"{JOB_SERVER_TIMEOUT_S:.0f} s: {exc}"
                ) from exc
            time.sleep(0.5)


@dataclass(frozen=True)
class RayNode:
    """A worker node joined to a ``RayHead``, on this machine with its own temp dir."""

    temp_dir: str

    def lose(self) -> None:
        """SIGKILL the node's processes and every process they started (its Ray workers
        included), as a machine that fails or is preempted: nothing exits tidily."""
        pids = set(pids_naming(self.temp_dir))
        pids |= {child for pid in pids for child in descendants(pid)}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def stop(self) -> None:
        stop_processes_naming(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def join_node(
    head: RayHead,
    num_cpus: int = 1,
    *,
    pythonpath: str | None = None,
    resources: dict[str, float] | None = None,
) -> RayNode:
    """``ray start --address`` of another node with ``num_cpus``, on free ports, with its
    own temp dir (the marker its processes are found by). ``pythonpath`` as ``start_head``;
    ``resources``: custom resources the node offers (``{"data_prep": 1000}``)."""
    node = RayNode(temp_dir=ray_temp_dir("rt-node-"))
    manager, objects, agent_listen, agent_grpc, runtime_env, metrics = free_ports(6)
    node_vars = {"RAY_AUTH_TOKEN": head.token, "RAY_AUTH_MODE": "token"}
    if pythonpath:
        node_vars["PYTHONPATH"] = pythonpath
    env = isolated_env(head.home / "node", without=("PYTHONPATH",), **node_vars)
    command = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        f"--address={head.gcs_address}",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={node.temp_dir}",
        f"--node-manager-port={manager}",
        f"--object-manager-port={objects}",
        f"--dashboard-agent-listen-port={agent_listen}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        "--disable-usage-stats",
    ]
    if resources:
        command.append(f"--resources={json.dumps(resources)}")
    try:
        started = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S
        )
        if started.returncode != 0:
            raise RuntimeError(
                f"ray start --address failed ({started.returncode}): {started.stderr[-2000:]}"
            )
    except BaseException:
        node.stop()
        raise
    return node
