"""Fixtures for tests against real clusters started by the tests themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raytrain_app.testing.ray_head import RayHead, start_head


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory) -> RayHead:
    """``ray start --head`` with token auth, private ports, temp dir and HOME."""
    head = start_head(tmp_path_factory.mktemp("head"))
    yield head
    head.stop()
    assert not head.processes(), "processes of the test's Ray head outlived its stop()"


@pytest.fixture(scope="session", autouse=True)
def tell_ci_the_cluster_tier_started():
    """Creates the file named by RAYTRAIN_CI_CLUSTER_TIER_STARTED, if set, when the first
    cluster test starts: .ci/run starts the compatibility tier's tests then, while the
    cluster tier's SLURM and Ray start-ups leave the CPU idle half the time."""
    marker = os.environ.get("RAYTRAIN_CI_CLUSTER_TIER_STARTED")
    if marker:
        Path(marker).touch()
    yield
