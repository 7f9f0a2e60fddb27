"""Where the driver's Ray comes from: a named cluster, a live session, or one started here.

Also what a plan is made against: a connected cluster's resources, else this machine's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import ray

from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.reachability import check_reachable
from raytrain_app.errors import RunFailedError, first_line
from raytrain_app.planning.environment import (
    Environment,
    apply_ray_train_defaults,
    detect_environment,
    ray_cluster_resources,
    unset_ray_train_defaults,
)
from raytrain_app.planning.rules import TrainingPlan, make_plan

# Ray logs, on every local start, that it turned token authentication on by default.
_TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
_DEFAULT_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


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
                # An embedded single-machine cluster sized like the plan assumed. It keeps
                # Ray's dashboard (the run's workers, logs, stacks; leaving it out saved no
                # measurable start-up time). Its job server runs code, so it binds to
                # localhost unless the user opts in.
                with _without_default_token_notice():
                    ray.init(
                        num_cpus=int((env.machine or env.resources).cpus),
                        dashboard_host=env.dashboard_host,
                        logging_level=logging.WARNING,
                    )
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
