"""Ray instances the benchmarks start, on ``raytrain_app.testing``: each with its own temp dir,
ports and HOME, stopped by PID; workers and clients can import ``benchmarks``.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from benchmarks.common import REPO_ROOT, CpuWatch
from raytrain_app.testing import ray_head
from raytrain_app.testing.isolation import isolated_env, ray_temp_dir
from raytrain_app.testing.ports import free_ports
from raytrain_app.testing.processes import stop_processes_naming

logger = logging.getLogger(__name__)

TEMP_PREFIX = "rt-b-"  # the benchmarks' Ray temp dirs


def pythonpath_with_repo() -> str:
    """This process's PYTHONPATH with the repo root first: ``benchmarks`` becomes importable
    (Ray workers inherit it)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


def subprocess_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment of a child that may start or join Ray: private HOME, no inherited cluster."""
    return isolated_env(home, PYTHONPATH=pythonpath_with_repo(), **extra)


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
        os.environ["PYTHONPATH"] = pythonpath_with_repo()
        self.temp_dir = ray_temp_dir(TEMP_PREFIX)
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


def start_head(root: Path, num_cpus: int) -> ray_head.RayHead:
    """A private head (``raytrain_app.testing.ray_head``) whose workers can import
    ``benchmarks`` and whose processes count as the suite's own CPU use."""
    temp_dir = ray_temp_dir(TEMP_PREFIX)
    # Before the start: its daemonised processes are the suite's own from their first tick.
    CpuWatch.get().add_marker(temp_dir)
    head = ray_head.start_head(
        root,
        num_cpus,
        pythonpath=pythonpath_with_repo(),
        temp_dir=temp_dir,
    )
    logger.info("started a Ray head at %s (temp dir %s)", head.gcs_address, temp_dir)
    return head


def client_env(head: ray_head.RayHead) -> dict[str, str]:
    """Environment of a client of ``head`` that can import ``benchmarks``."""
    return head.client_env(PYTHONPATH=pythonpath_with_repo())
