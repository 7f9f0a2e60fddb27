"""Fixtures of the workload tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny ops gain nothing from more threads, and a busy machine makes them much slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
