"""The GPU tier: real CUDA with 1 and 2 GPUs (``python -m pytest tests/gpu -m gpu`` on a
GPU host: docs/contributors/tests.md, "GPU hosts"). One Ray instance per session, with the
machine's GPUs.

Every test here is marked ``gpu`` where it can run: without CUDA, each is skipped without
starting anything. A test that needs 2 GPUs (``needs_two_gpus``) is marked
``gpu`` only on a machine that has them; with fewer it is skipped and left out of
``-m gpu``, so that on the common 1-GPU machine ``-m gpu`` runs every test it can and skips
none for want of a second GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from ray_sessions import session_ray

HERE = Path(__file__).resolve().parent
TWO_GPUS = "needs_two_gpus"


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{TWO_GPUS}: a GPU-tier test that needs 2 CUDA GPUs (tests/gpu/conftest.py)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items: touch only this directory's.
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    # The tests in this process first (seconds each), then those on Ray (a minute or two
    # each, compiling): a GPU lent for minutes runs as many tests as it can. The first GPU
    # run (docs/contributors/tests.md) reached only three Ray tests in its 300 s.
    items.sort(key=lambda item: item in ours and "gpu_ray" in getattr(item, "fixturenames", ()))
    gpus = visible_gpus()
    for item in ours:
        needed = 2 if item.get_closest_marker(TWO_GPUS) else 1
        if gpus == 0 or gpus >= needed:
            item.add_marker(pytest.mark.gpu)
        if gpus < needed:
            reason = "needs a CUDA GPU" if gpus == 0 else f"needs 2 CUDA GPUs, {gpus} visible"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpu_ray():
    """A Ray instance with this machine's GPUs, its own temp dir and ports; its workers
    import this directory's workloads (``gpu_witness``), as the test process does."""
    gpus = torch.cuda.device_count()
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), saved]))
    try:
        with session_ray(num_cpus=max(2 * gpus, 2), num_gpus=gpus) as resources:
            yield resources
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(autouse=True)
def fresh_cuda():
    """Every test starts with the whole GPU and torch.compile's caches empty in this
    process (the in-process tests train here; Ray's workers are processes of their own)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
