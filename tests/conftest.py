"""Shared test set-up: keep Ray and raytrain away from the user's home and clusters."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory):
    """A private HOME (Ray writes ~/.ray/auth_token there) and no inherited RAY_ADDRESS."""
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_ADDRESS")}
    os.environ["HOME"] = str(tmp_path_factory.mktemp("home"))
    os.environ.pop("RAY_ADDRESS", None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
