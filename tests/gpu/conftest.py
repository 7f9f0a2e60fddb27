"""The GPU tier: real CUDA with 1 and 2 GPUs. Every test here is marked ``gpu`` and skipped,
without starting anything, where CUDA is not available; one Ray instance per session
where it is (``python -m pytest tests/gpu`` on a GPU host: README.md, "GPU hosts")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ray_sessions import session_ray

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items: touch only this directory's.
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_ray():
    """A Ray instance with this machine's GPUs, its own temp dir and ports."""
    gpus = torch.cuda.device_count()
    with session_ray(num_cpus=max(2 * gpus, 2), num_gpus=gpus) as resources:
        yield resources
