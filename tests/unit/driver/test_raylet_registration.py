"""``driver.raylet_registration``: ray.init() of an embedded Ray finds its raylet within
20 ms of its registration, instead of at Ray's next one-second poll. A GCS of the test's
own and a fake clock; no Ray runs (tests/distributed/test_embedded_ray.py runs it on a real
one)."""

from __future__ import annotations

import pytest

from raytrain_app.driver import raylet_registration
from raytrain_app.driver.raylet_registration import after_registration, wait_until_registered

NODE = "ab12" * 14


class _Gcs:
    """The GCS's node table as Ray's reader gives it: the node shows up (alive) at the
    ``registers_at``-th look, or never."""

    def __init__(self, registers_at: int | None, fails: bool = False) -> None:
        self.registers_at, self.fails = registers_at, fails
        self.looks = 0
        self.disconnected = False

    def node_table(self) -> list[dict]:
        self.looks += 1
        if self.fails:
            raise RuntimeError("the GCS went away")
        other = {"NodeID": "cd34" * 14, "Alive": True}
        if self.registers_at is None or self.looks < self.registers_at:
            return [other]
        return [other, {"NodeID": NODE, "Alive": True}]

    def disconnect(self) -> None:
        self.disconnected = True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def gcs(monkeypatch):
    def install(gcs: _Gcs | None) -> _Gcs | None:
        monkeypatch.setattr(raylet_registration, "_gcs_state", lambda address: gcs)
        return gcs

    return install


def test_the_wait_asks_every_20_ms_until_the_raylet_registers(gcs):
    table, clock = gcs(_Gcs(registers_at=4)), _Clock()
    assert wait_until_registered("127.0.0.1:1", NODE, clock=clock, sleep=clock.sleep)
    # Found at the fourth look, 60 ms after the first: Ray's own lookup would have looked
    # again only a second after its first look.
    assert table.looks == 4 and clock.sleeps == [0.02] * 3
    assert table.disconnected


def test_a_raylet_that_never_registers_is_left_to_rays_lookup_after_the_limit(gcs):
    table, clock = gcs(_Gcs(registers_at=None)), _Clock()
    found = wait_until_registered("127.0.0.1:1", NODE, limit_s=1.0, clock=clock, sleep=clock.sleep)
    assert found is False
    assert clock.now == pytest.approx(101.0, abs=0.021) and table.looks == len(clock.sleeps) + 1
    assert table.disconnected


def test_a_gcs_that_fails_or_cannot_be_read_is_left_to_rays_lookup(gcs):
    clock = _Clock()
    table = gcs(_Gcs(registers_at=1, fails=True))
    assert wait_until_registered("127.0.0.1:1", NODE, clock=clock, sleep=clock.sleep) is False
    assert table.looks == 1 and table.disconnected and clock.sleeps == []
    gcs(None)  # a Ray without the reader this module uses
    assert wait_until_registered("127.0.0.1:1", NODE, clock=clock, sleep=clock.sleep) is False


def test_rays_lookup_runs_after_the_wait_with_its_own_arguments_and_result(monkeypatch):
    events: list[tuple] = []

    def rays_lookup(gcs_address: str, node_id: str) -> dict:
        """Ray's get_node."""
        events.append(("ray", gcs_address, node_id))
        return {"node_manager_port": 1234}

    monkeypatch.setattr(
        raylet_registration,
        "wait_until_registered",
        lambda address, node: events.append(("wait", address, node)) or True,
    )
    lookup = after_registration(rays_lookup)
    assert lookup("127.0.0.1:1", NODE) == {"node_manager_port": 1234}
    assert events == [("wait", "127.0.0.1:1", NODE), ("ray", "127.0.0.1:1", NODE)]
    assert lookup.__wrapped__ is rays_lookup and lookup.__doc__ == "Ray's get_node."
