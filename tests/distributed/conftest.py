"""One real Ray instance per test session: 2 CPUs, its own temp dir and ports."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest
import ray
from paths import EXAMPLES, TEST_WORKLOADS

from raytrain_app.planning.environment import apply_ray_train_defaults


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    # A short path: Ray's Unix sockets live under the temp dir and must stay < 108 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    apply_ray_train_defaults(embedded=True)  # a one-machine Ray, as raytrain's embedded one
    # Workers inherit the environment of the process that starts Ray: this is how the
    # examples/ user package becomes importable in them, as PYTHONPATH=examples does for users.
    saved_pythonpath = os.environ.get("PYTHONPATH")
    paths = [str(EXAMPLES), str(TEST_WORKLOADS)]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, saved_pythonpath]))
    # Ray's own ports are 0 (the OS picks free ones); the dashboard (the State API some
    # tests query) gets a free port too, so parallel sessions never collide.
    ray.init(num_cpus=2, dashboard_port=_free_port(), _temp_dir=temp_dir, logging_level="WARNING")
    yield ray.cluster_resources()
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    if saved_pythonpath is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved_pythonpath
