"""One real Ray instance per test session: 2 CPUs, its own temp dir and ports."""

from __future__ import annotations

import pytest
from fault_runs import fault_config
from ray_sessions import session_ray

import raytrain_app as rt


@pytest.fixture(scope="session")
def ray_cluster():
    with session_ray(num_cpus=2) as resources:
        yield resources


@pytest.fixture(scope="session")
def fault_reference(ray_cluster, tmp_path_factory):
    """The uninterrupted 4-epoch ``faults`` run that every interrupted run (a killed worker
    or driver, a stop signal) is compared with, bit for bit: trained once per session."""
    return rt.train(fault_config(tmp_path_factory.mktemp("ref"), "straight"), progress=False)
