"""Fail fast on an address nothing listens at, instead of waiting out Ray's connection retries.

``ray.init(address=...)`` and Ray's job client retry an unreachable address for a long time
before giving up with a multi-line error; one TCP connect with a short timeout tells a typo or
a stopped cluster apart in about a second, as a one-line :class:`BadInputError`.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from raytrain_app.errors import BadInputError

# Ray's own defaults when an address leaves the port out.
_DEFAULT_PORTS = {"": 6379, "ray": 10001, "http": 80, "https": 443}
# Addresses that name no remote endpoint: Ray looks the cluster up, or starts one here.
_NOT_REMOTE = ("auto", "local")


def parse_host_port(
    address: str, source: str = "--address", default_scheme: str = ""
) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port``, ``ray://host:port`` or ``http(s)://host:port/...``.

    Returns None for ``auto`` and ``local``, which name no endpoint to probe; ``source`` (the
    flag or variable the address came from) names it in the error for a malformed address.
    A missing port is Ray's default for the scheme (``default_scheme`` when none is given).
    """
    address = address.strip()
    if address in _NOT_REMOTE:
        return None
    scheme, _, rest = address.rpartition("://")
    scheme = scheme.lower() if "://" in address else default_scheme
    problem = None
    if scheme not in _DEFAULT_PORTS:
        problem = f"'{scheme}://' is not an address scheme Ray uses"
    else:
        try:
            parts = urlsplit(f"//{rest}")
            host, port = parts.hostname, parts.port
        except ValueError as exc:  # a port that is not a number, or out of range
            host, port, problem = None, None, str(exc)
        if problem is None and not host:
            problem = "it names no host"
    if problem:
        raise BadInputError(
            f"{source} {address!r} is not a Ray address ({problem}); pass HOST:PORT, "
            f"ray://HOST:PORT or the dashboard's http://HOST:PORT"
        )
    return host, port or _DEFAULT_PORTS[scheme]


def check_reachable(
    address: str | None,
    *,
    source: str = "--address",
    what: str = "a Ray cluster",
    hint: str = "start the cluster or pass the head's address ('ray status' on the head shows it)",
    default_scheme: str = "",
    timeout_s: float = 3.0,
) -> None:
    """Raise BadInputError unless something accepts a TCP connection at ``address``.

    Does nothing for no address, ``auto`` or ``local``. Only reachability is checked: whether a
    Ray process answers there is left to Ray itself.

    Args:
        address: the address as the user gave it (any form ``parse_host_port`` accepts).
        source: the flag or environment variable it came from, named in the message.
        what: what should be listening there, e.g. ``a Ray job server``.
        hint: the fix the message ends with.
        default_scheme: how to read an address without ``scheme://`` (Ray's job client reads
            it as ``http``, ``ray.init`` as a GCS ``host:port``).
        timeout_s: how long to wait for the connection.
    """
    endpoint = parse_host_port(address, source, default_scheme) if address else None
    if endpoint is None:
        return
    host, port = endpoint
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except socket.gaierror:
        reason = f"the host name '{host}' does not resolve"
    except ConnectionRefusedError:
        reason = f"nothing is listening on {host}:{port}"
    except TimeoutError:
        reason = f"{host}:{port} did not answer within {timeout_s:g} s"
    except OSError as exc:
        reason = f"{host}:{port} is unreachable ({exc.strerror or type(exc).__name__})"
    raise BadInputError(f"{source} {address}: {reason}, so {what} cannot be reached; {hint}")
