"""Shared test set-up: keep Ray and raytrain away from the user's home and clusters."""

from __future__ import annotations

import pytest

from raytrain_app.testing.isolation import private_home


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory):
    """A private HOME (Ray writes ~/.ray/auth_token there) and no inherited cluster variables."""
    with private_home(tmp_path_factory.mktemp("home")):
        yield
