"""One real Ray instance per test session: 2 CPUs, its own temp dir and ports."""

from __future__ import annotations

import os
import shutil

import pytest
import ray
from paths import EXAMPLES, TEST_WORKLOADS

from raytrain_app.planning.environment import apply_ray_train_defaults
from raytrain_app.testing.isolation import ray_temp_dir
from raytrain_app.testing.ports import free_ports


@pytest.fixture(scope="session")
def ray_cluster():
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
    ray.init(num_cpus=2, dashboard_port=dashboard_port, _temp_dir=temp_dir, logging_level="WARNING")
    yield ray.cluster_resources()
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    if saved_pythonpath is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved_pythonpath
