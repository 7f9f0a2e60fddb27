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
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import ray

from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.embedded_ray import (
    EmbeddedRay,
    forget_embedded_start,
    prepare_embedded_start,
    ray_started_here,
    start_embedded_ray,
)
from raytrain_app.driver.reachability import check_reachable
from raytrain_app.errors import RunFailedError, first_line
from raytrain_app.planning.cluster_resources import ray_cluster_resources
from raytrain_app.planning.environment import (
    Environment,
    cluster_address,
    detect_environment,
)
from raytrain_app.planning.rules import TrainingPlan, make_plan


class _StartBeside:
    """``ray.init()`` of an embedded Ray in a background thread, which then stays until
    released: Ray starts its processes to die with the thread that started them (Linux's
    parent-death signal follows the thread, not the process)."""

    def __init__(self, start: EmbeddedRay) -> None:
        self.error: BaseException | None = None
        self._added = prepare_embedded_start()
        self._ready = threading.Event()
        self._released = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(start,), name="raytrain-ray-start", daemon=True
        )
        self._thread.start()

    def _run(self, start: EmbeddedRay) -> None:
        try:
            start_embedded_ray(start)
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
        forget_embedded_start(self._added)

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
        _beside = _StartBeside(EmbeddedRay.here())
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
                forget_embedded_start(added_defaults)
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
        added = prepare_embedded_start()
        try:
            start_embedded_ray(EmbeddedRay.of(env))
        except BaseException:
            forget_embedded_start(added)
            raise
        return True, True, added
    except (ConnectionError, OSError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {target}" if target else "a local Ray"
        raise RunFailedError(f"could not start or reach {where}: {first_line(exc)}") from exc


def connected_plan(cfg: RaytrainConfig, address: str | None) -> tuple[Environment, TrainingPlan]:
    """The plan ``raytrain plan`` previews: against a running cluster when one is named,
    else against this SLURM allocation or this machine; any number of workers, with a
    warning and ``fits`` false where the target cannot host them."""
    env = detect_environment()
    if address or env.ray_address:
        with ray_session(address, env) as cluster_env:
            return cluster_env, make_plan(cfg, cluster_env, preview=True)
    return env, make_plan(cfg, env, preview=True)
