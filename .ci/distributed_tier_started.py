"""pytest plugin of .ci/run: tells the compatibility tier when the main suite's distributed
tier starts, by creating the file named by RAYTRAIN_CI_DISTRIBUTED_TIER_STARTED.
.ci/oldest-ray waits for it, then runs in the idle CPU class: the distributed tier keeps
both cores busy with training, so the background gets little and costs it little, where
beside the cluster tier (Ray and SLURM start-ups, timeouts, polling) it cost ~2 minutes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = os.environ.get("RAYTRAIN_CI_DISTRIBUTED_TIER_STARTED")
    if marker and item.path.parent.name == "distributed":
        Path(marker).touch()
