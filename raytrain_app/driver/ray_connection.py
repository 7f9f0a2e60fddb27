"""Where the driver's Ray comes from: a named cluster, a live session, or one started here.

Also what a plan is made against: a connected cluster's resources, else this machine's.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import ray

from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.reachability import check_reachable
from raytrain_app.errors import RunFailedError, first_line
from raytrain_app.planning.cluster_resources import ray_cluster_resources
from raytrain_app.planning.environment import (
    Environment,
    apply_ray_train_defaults,
    detect_environment,
    unset_ray_train_defaults,
)
from raytrain_app.planning.rules import TrainingPlan, make_plan

logger = logging.getLogger(__name__)

# Ray logs, on every local start, that it turned token authentication on by default.
_TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
_DEFAULT_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
LOOPBACK = "127.0.0.1"


class _DropDefaultTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_DEFAULT_TOKEN_NOTICE)


@contextmanager
def _without_default_token_notice() -> Iterator[None]:
    """Silence Ray's notice that token auth is on by default while it starts an embedded
    Ray: a user of one (bound to this machine) has nothing to act on. Ray's other warnings,
    the one that token auth is off included, still show."""
    notices = logging.getLogger(_TOKEN_SETUP_LOGGER)
    dropped = _DropDefaultTokenNotice()
    notices.addFilter(dropped)
    try:
        yield
    finally:
        notices.removeFilter(dropped)


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
    try:
        constants = importlib.import_module("ray._private.ray_constants")
    except ImportError:
        constants = None
    if not hasattr(constants, "ENABLE_RAY_CLUSTER"):
        logger.warning(
            "this Ray cannot be kept on 127.0.0.1: the local Ray's ports listen on every "
            "interface (token auth stays on)"
        )
        yield
        return
    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved


def _default_token_path() -> Path:
    """Where Ray keeps the token it generates: ``~/.ray/auth_token``."""
    return Path.home() / ".ray" / "auth_token"


def _token_to_generate() -> bool:
    """Whether ``ray.init()`` would generate a token: token auth on (Ray's default for a
    local cluster) and no token given."""
    mode = os.environ.get("RAY_AUTH_MODE", "token").lower()
    given = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    return mode == "token" and not given and not _default_token_path().exists()


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


def _start_embedded_ray(env: Environment) -> None:
    """``ray.init()`` of a single-machine cluster on loopback, its token file private."""
    if _token_to_generate():
        _create_private_token()
    # An embedded single-machine cluster sized like the plan assumed. It keeps Ray's
    # dashboard (the run's workers, logs, stacks; leaving it out saved no measurable
    # start-up time). Its job server runs code, so it binds to localhost unless the user
    # opts in.
    with _without_default_token_notice(), _listening_on_loopback_only():
        ray.init(
            num_cpus=int((env.machine or env.resources).cpus),
            dashboard_host=env.dashboard_host,
            logging_level=logging.WARNING,
            _node_ip_address=LOOPBACK,
        )
    _warn_if_token_readable()


@contextmanager
def ray_session(address: str | None, env: Environment) -> Iterator[Environment]:
    """Connect to ``address`` (or ``RAY_ADDRESS``), reuse a live session, or start Ray here.

    Yields the environment with the cluster's resources; shuts down only a Ray it started.
    """
    started = embedded = False
    added_defaults: list[str] = []
    if not ray.is_initialized():
        target = address or env.ray_address
        # Ray would retry an unreachable address for minutes; probe it first
        check_reachable(target, source="--address" if address else "RAY_ADDRESS")
        try:
            if target:
                ray.init(address=target, logging_level=logging.WARNING)
            else:
                _start_embedded_ray(env)
                embedded = True
                added_defaults = apply_ray_train_defaults(embedded=True)
        except (ConnectionError, OSError, RuntimeError, ValueError) as exc:
            where = f"the Ray cluster at {target}" if target else "a local Ray"
            raise RunFailedError(f"could not start or reach {where}: {first_line(exc)}") from exc
        started = True
    try:
        resources, gpu = ray_cluster_resources()
        if embedded:
            # Nothing can join an embedded Ray: plan against this machine, so asking for
            # more workers than it has fails now instead of waiting forever.
            resources = replace(resources, source="this machine")
        yield replace(env.with_resources(resources, gpu), embedded_ray=ray_started_here())
    finally:
        if started:
            ray.shutdown()
        unset_ray_train_defaults(added_defaults)


def ray_started_here() -> bool:
    """Whether this process started the Ray it is connected to (``ray.init()`` without an
    address, by raytrain or by the user): that Ray ends with this process."""
    # Ray has no public query; a Ray without this internal reads as "not started here",
    # which costs only the actors an embedded Ray could do without (driver.trainer).
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(worker, "_global_node", None)
    return bool(node is not None and node.head)


def connected_plan(cfg: RaytrainConfig, address: str | None) -> tuple[Environment, TrainingPlan]:
    """The plan ``raytrain plan`` previews: against a running cluster when one is named,
    else against this SLURM allocation or this machine; any number of workers, with a
    warning and ``fits`` false where the target cannot host them."""
    env = detect_environment()
    if address or env.ray_address:
        with ray_session(address, env) as cluster_env:
            return cluster_env, make_plan(cfg, cluster_env, preview=True)
    return env, make_plan(cfg, env, preview=True)
