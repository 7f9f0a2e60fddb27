"""One Ray instance for a test session: its own temp dir and ports, the test workloads
importable in its workers."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import ray
from paths import EXAMPLES, TEST_WORKLOADS

from raytrain_app.planning.environment import apply_ray_train_defaults
from raytrain_app.testing.isolation import ray_temp_dir
from raytrain_app.testing.ports import free_ports


@contextlib.contextmanager
def session_ray(num_cpus: int, num_gpus: int | None = None) -> Iterator[dict]:
    """``ray.init`` as raytrain's embedded Ray; yields the cluster's resources."""
    temp_dir = ray_temp_dir()
    apply_ray_train_defaults(embedded=True)  # a one-machine Ray, as raytrain's embedded one
    # Workers inherit the environment of the process that starts Ray: this is how the
    # examples/ user package becomes importable in them, as PYTHONPATH=examples does for users.
    saved_pythonpath = os.environ.get("PYTHONPATH")
    paths = [str(EXAMPLES), str(TEST_WORKLOADS)]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, saved_pythonpath]))
    # Ray's own ports are 0 (the OS picks free ones); the dashboard (the State API some
    # tests query) gets a free port too, so parallel sessions never collide.
    (dashboard_port,) = free_ports(1)
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        dashboard_port=dashboard_port,
        _temp_dir=temp_dir,
        logging_level="WARNING",
    )
    try:
        yield ray.cluster_resources()
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if saved_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_pythonpath
