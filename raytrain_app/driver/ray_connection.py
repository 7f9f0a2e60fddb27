"""Where the driver's Ray comes from: a named cluster, a live session, or one started here.

Also what a plan is made against: a connected cluster's resources, else this machine's.

A Ray started here for ``raytrain train`` starts in a background thread while the driver
imports torch and Ray Train and checks the run (``embedded_ray_beside``): the two took
3 s and 5 s one after the other (benchmarks/README.md, "First step").
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import secrets
import signal
import stat
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray

from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.reachability import check_reachable
from raytrain_app.errors import RunFailedError, first_line
from raytrain_app.planning.cluster_resources import ray_cluster_resources
from raytrain_app.planning.environment import (
    LOCAL_DASHBOARD_HOST,
    Environment,
    apply_ray_train_defaults,
    cluster_address,
    dashboard_host,
    detect_environment,
    detect_slurm,
    local_cpus,
    token_auth_without_a_token,
    unset_ray_train_defaults,
)
from raytrain_app.planning.rules import TrainingPlan, make_plan

logger = logging.getLogger(__name__)

# Notices Ray logs while it starts an embedded Ray that its user has nothing to act on
# (logger -> the message's start): token authentication is on by default (a user of a Ray
# bound to this machine), and, started in the background (``embedded_ray_beside``), that
# ray.init set no SIGTERM handler (the main thread sets Ray's own: ``_exit_on_sigterm``).
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
class _EmbeddedRay:
    """What ``ray.init()`` of an embedded Ray is given: this machine's CPUs (as the plan
    assumed) and the dashboard UI's interface (None: no UI)."""

    num_cpus: int
    dashboard_host: str | None

    @classmethod
    def of(cls, env: Environment) -> _EmbeddedRay:
        return cls(int((env.machine or env.resources).cpus), env.dashboard_host)

    @classmethod
    def here(cls) -> _EmbeddedRay:
        """As ``of(detect_environment())`` would, without the GPU probe's torch import."""
        return cls(local_cpus(detect_slurm(os.environ)), dashboard_host(os.environ))


# The environment of the Ray raytrain started here (its processes inherit this process's
# environment as it was when it started), while it runs: ``inherited_by_ray_workers``.
_embedded_env: dict[str, str] | None = None


def _prepare_embedded_start() -> list[str]:
    """Before an embedded Ray starts, in the main thread (another thread may read the
    environment meanwhile): set Ray Train's defaults where its processes inherit them,
    and note the environment they inherit.

    Returns:
        The defaults set (the user's own values stay): ``_forget_embedded_start`` takes
        them back.
    """
    global _embedded_env
    added = apply_ray_train_defaults(embedded=True)
    _embedded_env = dict(os.environ)
    return added


def _forget_embedded_start(added: list[str]) -> None:
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


def _start_embedded_ray(start: _EmbeddedRay) -> None:
    """``ray.init()`` of a single-machine cluster on loopback, its token file private."""
    if _token_to_generate():
        _create_private_token()
    # An embedded single-machine cluster sized like the plan assumed. Ray's dashboard UI
    # only where asked for (RAYTRAIN_DASHBOARD_HOST): ray.init() waits for its modules'
    # processes. Ray's job server runs either way and runs code, so it binds to localhost
    # unless the user names another interface.
    with _without_start_notices(), _listening_on_loopback_only():
        ray.init(
            num_cpus=start.num_cpus,
            include_dashboard=start.dashboard_host is not None,
            dashboard_host=start.dashboard_host or LOCAL_DASHBOARD_HOST,
            logging_level=logging.WARNING,
            _node_ip_address=LOOPBACK,
        )
    _warn_if_token_readable()


class _StartBeside:
    """``ray.init()`` of an embedded Ray in a background thread, which then stays until
    released: Ray starts its processes to die with the thread that started them (Linux's
    parent-death signal follows the thread, not the process)."""

    def __init__(self, start: _EmbeddedRay) -> None:
        self.error: BaseException | None = None
        self._added = _prepare_embedded_start()
        self._ready = threading.Event()
        self._released = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(start,), name="raytrain-ray-start", daemon=True
        )
        self._thread.start()

    def _run(self, start: _EmbeddedRay) -> None:
        try:
            _start_embedded_ray(start)
        except BaseException as exc:  # raised again in the thread that waits for it
            self.error = exc
        finally:
            self._ready.set()
        self._released.wait()

    def wait(self) -> None:
        """Until ``ray.init()`` returned; raises what it raised."""
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def release(self) -> None:
        """Let the thread end: only once the Ray it started is shut down."""
        self._released.set()
        self._thread.join()
        _forget_embedded_start(self._added)

    def stop(self) -> None:
        """Wait for the start, then shut down what it started (a failed start: nothing)."""
        self._ready.wait()
        try:
            if self.error is None and ray.is_initialized():
                ray.shutdown()
        finally:
            self.release()


# What ray.init() imports on its way that the driver's imports of Ray Train load too
# (Ray 2.60), with their own imports (click, colorful).
_SHARED_RAY_MODULES = (
    "ray._common.usage.usage_lib",
    "ray.autoscaler._private.cli_logger",
    "ray.dashboard",
)
_beside: _StartBeside | None = None  # begun by embedded_ray_beside, not yet taken over


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(signum)


@contextmanager
def embedded_ray_beside(address: str | None = None, local: bool = False) -> Iterator[None]:
    """Where a run of ``address`` / ``local`` would start Ray here, start it now in the
    background, so that what the body does before it connects (the driver's imports, the
    checks, the plan: 3 s) runs beside Ray's start-up (5 s) instead of before it.

    ``ray_session`` takes that Ray over (and shuts it down at its end). A body that ends
    before (bad input, Ctrl-C) waits for the start and shuts down what it started: no Ray
    is left running. Elsewhere (a cluster's address, a Ray already up, local mode) this
    does nothing.
    """
    global _beside
    if _beside is not None or not ray_would_start_here(address, local):
        yield
        return
    _preimport_shared_ray_modules()
    with _sigterm_exits():
        _beside = _StartBeside(_EmbeddedRay.here())
        try:
            yield
        finally:
            start, _beside = _beside, None
            if start is not None:  # not taken over: the body ended before connecting
                start.stop()


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """What ``ray.init()`` sets in the main thread, which it cannot from another: SIGTERM
    exits through ``finally`` blocks and ``atexit``, which stop Ray. Put back afterwards
    unless replaced meanwhile."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
            signal.signal(signal.SIGTERM, previous)


def ray_would_start_here(address: str | None, local: bool) -> bool:
    """Whether a run of ``address`` / ``local`` would start an embedded Ray in this process:
    no cluster named (``RAY_ADDRESS`` is ``Environment.ray_address``), not local mode, and
    no Ray up in this process yet."""
    elsewhere = local or address or cluster_address(os.environ) or ray.is_initialized()
    return not elsewhere


def embedded_ray_starting() -> bool:
    """Whether ``embedded_ray_beside`` is starting (or has started) the Ray the run will
    use: it is being started on this machine, as when none is up yet."""
    return _beside is not None


def _preimport_shared_ray_modules() -> None:
    """Import in this thread the modules that both ``ray.init()`` and the body's imports
    (Ray Train's) load, before the two run at once: where two threads import a circle of
    modules from both ends, Python hands one of them a module run only in part (these take
    0.01 s; a Ray without one of them loses nothing)."""
    for module in _SHARED_RAY_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


def _take_beside(address: str | None, env: Environment) -> _StartBeside | None:
    """The background start of this process's embedded Ray, handed over (once)."""
    global _beside
    if address or env.ray_address:
        return None
    start, _beside = _beside, None
    return start


@contextmanager
def ray_session(address: str | None, env: Environment) -> Iterator[Environment]:
    """Connect to ``address`` (or ``RAY_ADDRESS``), reuse a live session, or start Ray here
    (or take over the Ray ``embedded_ray_beside`` started).

    Yields the environment with the cluster's resources; shuts down only a Ray it started.
    """
    beside = _take_beside(address, env)
    try:
        started, embedded, added_defaults = _connect(address, env, beside)
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
            if embedded and beside is None:  # a Ray started beside forgets its own start
                _forget_embedded_start(added_defaults)
    finally:
        if beside is not None:
            beside.release()


def _connect(
    address: str | None, env: Environment, beside: _StartBeside | None
) -> tuple[bool, bool, list[str]]:
    """Ray connected or started for ``ray_session``: whether it started one (and ends it),
    whether that is an embedded Ray, and the Ray Train defaults it set for it (those of a
    Ray started ``beside`` are its own)."""
    if beside is None and ray.is_initialized():
        return False, False, []
    target = address or env.ray_address
    # Ray would retry an unreachable address for minutes; probe it first
    check_reachable(target, source="--address" if address else "RAY_ADDRESS")
    try:
        if target:
            ray.init(address=target, logging_level=logging.WARNING)
            return True, False, []
        if beside:
            beside.wait()
            return True, True, []
        added = _prepare_embedded_start()
        try:
            _start_embedded_ray(_EmbeddedRay.of(env))
        except BaseException:
            _forget_embedded_start(added)
            raise
        return True, True, added
    except (ConnectionError, OSError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {target}" if target else "a local Ray"
        raise RunFailedError(f"could not start or reach {where}: {first_line(exc)}") from exc


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
