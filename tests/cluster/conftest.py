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


@pytest.fixture(autouse=True)
def tell_ci_the_slurm_tests_started(request):
    """Creates the file named by RAYTRAIN_CI_SLURM_TESTS_STARTED, if set, when the first
    SLURM test starts: .ci/run starts the compatibility tier's tests then, while the SLURM
    jobs wait on SLURM's scheduler and Ray's start-ups and leave the CPU idle."""
    marker = os.environ.get("RAYTRAIN_CI_SLURM_TESTS_STARTED")
    if marker and request.path.name.startswith("test_slurm"):
        Path(marker).touch()
