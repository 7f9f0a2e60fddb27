"""The address probe: parsing every form of address, and failing fast where nothing listens."""

from __future__ import annotations

import socket

import pytest

from raytrain_app.driver import reachability
from raytrain_app.driver.reachability import check_reachable, parse_host_port
from raytrain_app.errors import BadInputError
from raytrain_app.testing.ports import free_ports


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.5:6379", ("10.0.0.5", 6379)),
        ("head", ("head", 6379)),
        ("ray://head:10001", ("head", 10001)),
        ("ray://head", ("head", 10001)),
        ("http://head:8265", ("head", 8265)),
        ("HTTP://head:8265/", ("head", 8265)),
        ("https://head", ("head", 443)),
        ("[::1]:6379", ("::1", 6379)),
        (" head:1 ", ("head", 1)),
        ("auto", None),
        ("local", None),
    ],
)
def test_parse_host_port(address, expected):
    assert parse_host_port(address) == expected


def test_a_bare_address_can_default_to_http():
    assert parse_host_port("head", default_scheme="http") == ("head", 80)
    assert parse_host_port("head:8265", default_scheme="http") == ("head", 8265)


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("head:port", "Port could not be cast"),
        ("head:70000", "out of range"),
        ("tcp://head:1", "'tcp://' is not an address scheme"),
        ("http://:8265", "names no host"),
    ],
)
def test_a_malformed_address_names_its_source_and_the_forms(address, problem):
    with pytest.raises(BadInputError) as info:
        parse_host_port(address, "RAY_ADDRESS")
    message = str(info.value)
    assert message.startswith(f"RAY_ADDRESS {address!r} is not a Ray address")
    assert problem in message and "pass HOST:PORT" in message


@pytest.fixture
def listening_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.fixture
def closed_port():
    return free_ports(1)[0]  # free: nothing listens there


def test_a_listening_address_passes(listening_port):
    for address in (f"127.0.0.1:{listening_port}", f"http://127.0.0.1:{listening_port}"):
        check_reachable(address)


@pytest.mark.parametrize("address", [None, "", "auto", "local"])
def test_no_remote_address_is_not_probed(monkeypatch, address):
    monkeypatch.setattr(socket, "create_connection", pytest.fail)
    check_reachable(address)


def test_nothing_listening_fails_fast_in_one_line(closed_port):
    with pytest.raises(BadInputError) as info:
        check_reachable(f"ray://127.0.0.1:{closed_port}")
    message = str(info.value)
    assert message.startswith(f"--address ray://127.0.0.1:{closed_port}: nothing is listening")
    assert "start the cluster" in message and "\n" not in message


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (socket.gaierror(-2, "Name or service not known"), "the host name 'head' does not resolve"),
        (TimeoutError(), "head:6379 did not answer within 0.5 s"),
        (OSError(113, "No route to host"), "head:6379 is unreachable (No route to host)"),
    ],
)
def test_each_failure_is_named(monkeypatch, error, reason):
    def connect(endpoint, timeout):
        assert endpoint == ("head", 6379) and timeout == 0.5
        raise error

    monkeypatch.setattr(reachability.socket, "create_connection", connect)
    with pytest.raises(BadInputError) as info:
        check_reachable(
            "head:6379", source="RAY_ADDRESS", what="a Ray job server", hint="fix it", timeout_s=0.5
        )
    assert str(info.value) == (
        f"RAY_ADDRESS head:6379: {reason}, so a Ray job server cannot be reached; fix it"
    )
