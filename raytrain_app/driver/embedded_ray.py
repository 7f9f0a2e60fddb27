"""The Ray that raytrain starts on this machine for a run (an embedded Ray): how it starts
(sized as the plan assumed, on loopback only, its token file private, no dashboard process
unless its UI is asked for, its raylet found as soon as it registers, Ray's start notices
that its user has nothing to act on left out) and what its processes inherit from the
driver (``inherited_by_ray_workers``). ``ray_connection`` decides when it starts.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import ray

from raytrain_app.driver.raylet_registration import after_registration
from raytrain_app.planning.environment import (
    LOCAL_DASHBOARD_HOST,
    Environment,
    apply_ray_train_defaults,
    dashboard_host,
    detect_slurm,
    local_cpus,
    token_auth_without_a_token,
    unset_ray_train_defaults,
)

logger = logging.getLogger(__name__)

# Notices Ray logs while it starts an embedded Ray that its user has nothing to act on
# (logger -> the message's start): token authentication is on by default (a user of a Ray
# bound to this machine), and, started in the background
# (``ray_connection.embedded_ray_beside``), that ray.init set no SIGTERM handler (the main
# thread sets Ray's own there).
_NOTICES = {
    "ray._private.authentication.authentication_token_setup": (
        "Token authentication is enabled for this Ray cluster"
    ),
    "ray._private.worker": "SIGTERM handler is not set because current thread",
}
LOOPBACK = "127.0.0.1"


class _DropNotice(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


@contextmanager
def _without_start_notices() -> Iterator[None]:
    """Silence ``_NOTICES`` while Ray starts an embedded Ray. Ray's other warnings, the one
    that token auth is off included, still show."""
    dropped = [(logging.getLogger(name), _DropNotice(start)) for name, start in _NOTICES.items()]
    for notices, notice in dropped:
        notices.addFilter(notice)
    try:
        yield
    finally:
        for notices, notice in dropped:
            notices.removeFilter(notice)


def _rays_own(module: str, name: str, within: str | None = None) -> object | None:
    """Ray's module ``module`` (or its class ``within`` there) where it defines ``name``
    itself, for ``_replaced``; None in a Ray without it, which then starts as it would."""
    try:
        owner = importlib.import_module(module)
        if within is not None:
            owner = getattr(owner, within)
    except (ImportError, AttributeError):
        return None
    return owner if name in vars(owner) else None


@contextmanager
def _replaced(owner: object, name: str, value: object) -> Iterator[None]:
    """``owner``'s own attribute ``name`` is ``value`` for the length of the block (Ray's
    start reads it), then what it was."""
    saved = vars(owner)[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextmanager
def _listening_on_loopback_only() -> Iterator[None]:
    """Keep the Ray that ``ray.init()`` starts here on 127.0.0.1: its GCS, raylet, object
    manager, agents and workers listen on loopback only, not on every interface.

    Ray binds its servers to the node's address, and to every interface unless that address
    is loopback; ``ray.init`` replaces a loopback ``_node_ip_address`` by this machine's
    address unless ``ENABLE_RAY_CLUSTER`` is off, as it is on macOS and Windows. It is read
    only while the node starts, and nothing can join an embedded Ray, so it is off for that
    long. A Ray without it is started as Ray starts it, token auth still on.
    """
    constants = _rays_own("ray._private.ray_constants", "ENABLE_RAY_CLUSTER")
    if constants is None:
        logger.warning(
            "this Ray cannot be kept on 127.0.0.1: the local Ray's ports listen on every "
            "interface (token auth stays on)"
        )
        yield
        return
    with _replaced(constants, "ENABLE_RAY_CLUSTER", False):
        yield


def _skip_dashboard_process(node: object, **_: object) -> None:
    """Stands in for ``Node.start_api_server`` while an embedded Ray without a UI starts."""
    logger.debug("the local Ray starts without its dashboard process (no UI asked for)")


@contextmanager
def _without_dashboard_process(ui: bool) -> Iterator[None]:
    """Start an embedded Ray without Ray's dashboard process unless its UI was asked for.

    Without the UI (``include_dashboard=False``) that process serves nothing: Ray 2.60 loads
    only its usage-statistics module there and opens no HTTP server, no job API. Yet
    ``ray.init()`` starts it before the raylet and waits until it is up: 0.95-1.3 s of CPU
    on the way to the first step on 2 cores (benchmarks/README.md, "First step"). Ray's
    metrics endpoint (the dashboard agent of each node) and ``ray status`` (the GCS and
    the autoscaler's monitor) do not depend on it. Ray's usage statistics, reported from
    that process when they are on, are not reported for such a Ray. A Ray without
    ``Node.start_api_server`` starts it as usual.
    """
    node_class = _rays_own("ray._private.node", "start_api_server", within="Node")
    if ui or node_class is None:
        yield
        return
    with _replaced(node_class, "start_api_server", _skip_dashboard_process):
        yield


@contextmanager
def _raylet_found_once_registered() -> Iterator[None]:
    """While an embedded Ray starts, ``ray.init()`` finds its raylet within 20 ms of its
    registration instead of at Ray's next one-second poll (``driver.raylet_registration``).
    A Ray without ``services.get_node`` is started as Ray starts it."""
    services = _rays_own("ray._private.services", "get_node")
    if services is None:
        yield
        return
    with _replaced(services, "get_node", after_registration(vars(services)["get_node"])):
        yield


def _default_token_path() -> Path:
    """Where Ray keeps the token it generates: ``~/.ray/auth_token``."""
    return Path.home() / ".ray" / "auth_token"


def _token_to_generate() -> bool:
    """Whether ``ray.init()`` would generate a token: token auth on (Ray's default for a
    local cluster) and no token given."""
    return token_auth_without_a_token(os.environ) and not _default_token_path().exists()


def _create_private_token() -> None:
    """Write the token ``ray.init()`` would generate, readable by this user alone.

    Ray 2.60 writes it with a plain ``open(path, "w")``: mode 0644 under the usual umask, so
    any user of the machine could read it and use the local Ray. Created 0600 here (and
    ``~/.ray`` 0700 if new), Ray finds a token and uses it as is.
    """
    path = _default_token_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made one meanwhile: Ray uses that
        return
    with os.fdopen(fd, "w") as token:
        token.write(secrets.token_hex(32))  # what Ray's own generator writes
    logger.debug("created %s (mode 0600) for the local Ray's token auth", path)


def make_token_private_before_start() -> None:
    """Before ``ray.init()`` starts a local Ray: where Ray would generate its token file,
    write it first, readable by this user alone (Ray then uses it as it is)."""
    if _token_to_generate():
        _create_private_token()


def _warn_if_token_readable() -> None:
    """Say so when the token file Ray reads is readable by other users (a file made
    before raytrain created it 0600, or by hand); it is the user's file, left as it is."""
    path = _default_token_path()
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return
    if mode & 0o077:
        logger.warning(
            "%s is readable by other users of this machine (mode %o), who can use it to run "
            "code on your Ray; run chmod 600 %s",
            path,
            mode,
            path,
        )


@dataclass(frozen=True)
class EmbeddedRay:
    """What ``ray.init()`` of an embedded Ray is given: this machine's CPUs (as the plan
    assumed) and the dashboard UI's interface (None: no UI)."""

    num_cpus: int
    dashboard_host: str | None

    @classmethod
    def of(cls, env: Environment) -> EmbeddedRay:
        return cls(int((env.machine or env.resources).cpus), env.dashboard_host)

    @classmethod
    def here(cls) -> EmbeddedRay:
        """As ``of(detect_environment())`` would, without the GPU probe's torch import."""
        return cls(local_cpus(detect_slurm(os.environ)), dashboard_host(os.environ))


# The environment of the Ray raytrain started here (its processes inherit this process's
# environment as it was when it started), while it runs: ``inherited_by_ray_workers``.
_embedded_env: dict[str, str] | None = None


def prepare_embedded_start() -> list[str]:
    """Before an embedded Ray starts, and before the thread that starts it begins (which
    reads the environment as Ray spawns its processes): set Ray Train's defaults where
    those processes inherit them, and note the environment they inherit.

    Returns:
        The defaults set (the user's own values stay): ``forget_embedded_start`` takes
        them back.
    """
    global _embedded_env
    added = apply_ray_train_defaults(embedded=True)
    _embedded_env = dict(os.environ)
    return added


def forget_embedded_start(added: list[str]) -> None:
    """Once the embedded Ray has stopped (or failed to start): its defaults are unset, so
    that a later session in this process (on a cluster, say) starts from the user's own
    environment."""
    global _embedded_env
    _embedded_env = None
    unset_ray_train_defaults(added)


def inherited_by_ray_workers(variables: Mapping[str, str]) -> set[str]:
    """The names among ``variables`` whose values every worker process of the connected
    Ray has already: those the Ray that raytrain started here inherited. None elsewhere:
    a cluster's workers, or those of a Ray the user started, get what they need from a
    runtime env."""
    inherited = _embedded_env
    if inherited is None or not ray_started_here():
        return set()
    return {name for name, value in variables.items() if inherited.get(name) == value}


def start_embedded_ray(start: EmbeddedRay) -> None:
    """``ray.init()`` of a single-machine cluster on loopback, its token file private."""
    make_token_private_before_start()
    # An embedded single-machine cluster sized like the plan assumed. Ray's dashboard only
    # where its UI is asked for (RAYTRAIN_DASHBOARD_HOST): ray.init() waits for its
    # processes. Its server runs code (the job API), so it binds to localhost unless the
    # user names another interface.
    ui = start.dashboard_host is not None
    with (
        _without_start_notices(),
        _listening_on_loopback_only(),
        _without_dashboard_process(ui),
        _raylet_found_once_registered(),
    ):
        ray.init(
            num_cpus=start.num_cpus,
            include_dashboard=ui,
            dashboard_host=start.dashboard_host or LOCAL_DASHBOARD_HOST,
            logging_level=logging.WARNING,
            _node_ip_address=LOOPBACK,
        )
    _warn_if_token_readable()


def ray_started_here() -> bool:
    """Whether this process started the Ray it is connected to (``ray.init()`` without an
    address, by raytrain or by the user): that Ray ends with this process."""
    # Ray has no public query; a Ray without this internal reads as "not started here",
    # which costs only the actors an embedded Ray could do without (driver.trainer).
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(worker, "_global_node", None)
    return bool(node is not None and node.head)
