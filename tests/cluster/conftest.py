"""Fixtures for tests against real clusters started by the tests themselves."""

from __future__ import annotations

import pytest

from raytrain_app.testing.ray_head import RayHead, start_head


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory) -> RayHead:
    """``ray start --head`` with token auth, private ports, temp dir and HOME."""
    head = start_head(tmp_path_factory.mktemp("head"))
    yield head
    head.stop()
    assert not head.processes(), "processes of the test's Ray head outlived its stop()"
