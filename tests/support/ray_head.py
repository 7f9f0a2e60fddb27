"""A private Ray head for tests: own ports, temp dir, HOME and token; stopped by PID.

``ray stop`` would stop every Ray on the machine, so the head's processes are found by
their unique temp dir in ``/proc`` and signalled one by one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class RayHead:
    """A running head node and what a client needs to reach it."""

    dashboard_url: str
    gcs_address: str
    token: str
    temp_dir: str
    home: Path

    def client_env(self, with_token: bool = True) -> dict[str, str]:
        """Environment for a raytrain client process (its own HOME, the token or none)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"
        }
        env["HOME"] = str(self.home / "client")
        if with_token:
            env["RAY_AUTH_TOKEN"] = self.token
        return env

    def pids(self) -> list[int]:
        """Processes of this head: every one whose command line names its temp dir."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if self.temp_dir.encode() in cmdline:
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        # A test head's state is thrown away: a short grace, then SIGKILL (some of Ray's
        # processes take over 10 s to honour SIGTERM while a job is being torn down).
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):  # it may have exited already
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)


def start_head(root: Path, num_cpus: int = 2) -> RayHead:
    """``ray start --head`` with token auth on private ports; waits for the job server."""
    (
        gcs,
        dashboard,
        node_manager,
        object_manager,
        agent_listen,
        agent_grpc,
        runtime_env,
        metrics,
    ) = free_ports(8)
    temp_dir = tempfile.mkdtemp(prefix="rt-head-", dir="/tmp")
    home = root / "home"
    (home / "client").mkdir(parents=True)
    token = secrets.token_hex(16)
    # No PYTHONPATH from other tests: user code must reach the head through the job itself.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    # ray start --head turns token auth on when a token exists; the job server then
    # refuses requests without it.
    env.update(HOME=str(home), RAY_AUTH_TOKEN=token, RAY_AUTH_MODE="token")
    # Jobs run `raytrain` on the head: put this venv's scripts on its PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    command = [
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
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--dashboard-agent-listen-port={agent_listen}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        "--disable-usage-stats",
        # Worker ports keep Ray's default range: each worker binds a free one in it.
    ]
    head = RayHead(f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}", token, temp_dir, home)
    subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=120)
    _wait_for_job_server(head)
    return head


def _wait_for_job_server(head: RayHead, timeout: float = 60) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    request = urllib.request.Request(
        f"{head.dashboard_url}/api/jobs/", headers={"Authorization": f"Bearer {head.token}"}
    )
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                head.stop()
                raise
            time.sleep(0.5)
