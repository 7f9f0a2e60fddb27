"""Ray instances the benchmarks start: each with its own temp dir, ports and HOME.

``ray stop`` would stop every Ray on the machine, so processes are found by their unique
temp dir in ``/proc`` and signalled one by one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO_ROOT, CpuWatch

logger = logging.getLogger(__name__)


def short_temp_dir() -> str:
    """A Ray temp dir with a short path: Ray's Unix sockets must stay under 108 bytes."""
    return tempfile.mkdtemp(prefix="rt-b-", dir="/tmp")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def pythonpath_with_repo(current: str | None = None) -> str:
    """PYTHONPATH that makes ``benchmarks`` importable (Ray workers inherit it)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), current]))


def subprocess_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment of a child that may start or join Ray: private HOME, no inherited cluster."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"
    }
    home.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(home)
    env["PYTHONPATH"] = pythonpath_with_repo(os.environ.get("PYTHONPATH"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def pids_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (a unique temp dir)."""
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def stop_processes_naming(text: str, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every process whose command line names ``text``."""
    for sig, grace in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids_naming(text):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids_naming(text) and time.monotonic() < deadline:
            time.sleep(0.2)


@contextlib.contextmanager
def private_home(root: Path) -> Iterator[Path]:
    """Point HOME of this process at ``root`` (Ray writes ~/.ray/auth_token there)."""
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_ADDRESS")}
    root.mkdir(parents=True, exist_ok=True)
    os.environ["HOME"] = str(root)
    os.environ.pop("RAY_ADDRESS", None)
    try:
        yield root
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class LocalRay:
    """A Ray instance in this process, started on first use, for in-process raytrain runs.

    raytrain reuses an initialised Ray, so every ``raytrain_app.train``/``tune`` call of
    the suite runs on this one instance. Workers inherit PYTHONPATH (with the repo root,
    for benchmark-only workloads) from this process.
    """

    def __init__(self, num_cpus: int, num_gpus: int | None = None) -> None:
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.temp_dir: str | None = None

    def ensure(self) -> None:
        import ray

        from raytrain_app.planning.environment import apply_ray_train_defaults

        if ray.is_initialized():
            return
        apply_ray_train_defaults(embedded=True)  # as raytrain's own embedded Ray
        os.environ["PYTHONPATH"] = pythonpath_with_repo(os.environ.get("PYTHONPATH"))
        self.temp_dir = short_temp_dir()
        (dashboard_port,) = free_ports(1)
        ray.init(
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
            dashboard_port=dashboard_port,
            _temp_dir=self.temp_dir,
            logging_level=logging.WARNING,
            # Worker lines (epoch logs of every run) would bury the benchmark's own log.
            log_to_driver=False,
        )
        logger.info(
            "started Ray in this process (%d CPUs, temp dir %s)", self.num_cpus, self.temp_dir
        )

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.temp_dir:
            stop_processes_naming(self.temp_dir)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


@dataclass
class RayHead:
    """A ``ray start --head`` cluster on private ports; what a client needs to reach it."""

    gcs_address: str
    token: str
    temp_dir: str
    home: Path

    def client_env(self) -> dict[str, str]:
        return subprocess_env(
            self.home / "client", RAY_AUTH_TOKEN=self.token, RAY_AUTH_MODE="token"
        )

    def stop(self) -> None:
        stop_processes_naming(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_head(root: Path, num_cpus: int) -> RayHead:
    """Start a head node with token auth on free ports and its own temp dir and HOME."""
    gcs, dashboard, node_manager, object_manager, agent_listen, agent_grpc, runtime_env, metrics = (
        free_ports(8)
    )
    temp_dir = short_temp_dir()
    CpuWatch.get().add_marker(temp_dir)  # its daemonised processes are the suite's own
    token = secrets.token_hex(16)
    head = RayHead(f"127.0.0.1:{gcs}", token, temp_dir, root / "home")
    env = subprocess_env(head.home / "head", RAY_AUTH_TOKEN=token, RAY_AUTH_MODE="token")
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
    ]
    try:
        subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=120)
    except (subprocess.SubprocessError, OSError):
        head.stop()
        raise
    logger.info("started a Ray head at %s (temp dir %s)", head.gcs_address, temp_dir)
    return head
