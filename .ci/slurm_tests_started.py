"""pytest plugin of .ci/run: tells the compatibility tier when the main suite's SLURM tests
start, by creating the file named by RAYTRAIN_CI_SLURM_TESTS_STARTED. .ci/oldest-ray waits
for it: the SLURM jobs wait on SLURM's scheduler and on Ray's start-ups and leave the CPU
idle, where the tiers before them keep it busy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = os.environ.get("RAYTRAIN_CI_SLURM_TESTS_STARTED")
    if marker and item.path.name.startswith("test_slurm"):
        Path(marker).touch()
