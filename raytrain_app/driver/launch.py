"""A ``Launch``: everything a run or a sweep is started with, made once, in three steps.

1. ``Launch.checked``: before Ray is used: the config's sources and trackers, the run
   directory (resolved here, once: it depends on ``experiment.name`` and ``output_dir``
   alone), and, where Ray would start on this machine, the plan against this machine and
   whether the run directory takes the resolved config: bad input exits 2 without waiting
   for a Ray. A run directory another run writes is refused here too. ``raytrain train``
   starts an embedded Ray beside these checks and the imports before them
   (``ray_connection.embedded_ray_beside``), and stops it when they refuse the run.
2. ``Launch.connected``: connects to Ray (or takes over the one started beside step 1;
   local mode: none), plans against the resources
   it offers (the driver may sit on a CPU-only login node of a GPU cluster), checks that
   every node sees a local run directory, and that the directory takes the resolved config.
3. ``Launch.lease``: holds the run directory's lease while the body runs, and checks the
   directory again under it: of two runs that both passed step 1, only one gets here.

An executor then runs it (``driver.executors``: Ray Train, local mode, torchrun's other
processes; ``sweep.tuning``: a Tune sweep). What differs between a run and a sweep is
their ``Command``: how each plans, and whether Ray Train runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.local_run import local_processes_config, torchrun_rank
from raytrain_app.driver.ray_connection import embedded_ray_starting, ray_session
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.driver.run_lease import hold_run_lease, refuse_if_held
from raytrain_app.driver.shared_storage import check_shared
from raytrain_app.errors import BadInputError
from raytrain_app.planning.environment import (
    Environment,
    apply_ray_train_defaults,
    detect_environment,
)
from raytrain_app.tracking.trackers import check_tracking_installed
from raytrain_app.workloads import check_sources

# A command's plan of ``cfg`` against an environment: (its plan, the config it writes).
Planner = Callable[[RaytrainConfig, Environment], tuple[Any, RaytrainConfig]]


@dataclass(frozen=True)
class Command:
    """What a launch is for.

    Attributes:
        name: ``train`` or ``tune``: what a second run the lease refuses is told.
        plan: the command's plan (a ``TrainingPlan``; a sweep's checked search space).
        resolves_config: the plan replaces the config's ``auto`` values, so the config the
            run directory holds is known only once planned; a sweep writes its config as is.
        ray_train: runs a ``TorchTrainer``, which reads Ray Train's driver variables.
    """

    name: str
    plan: Planner
    resolves_config: bool
    ray_train: bool


@dataclass
class Launch:
    """One run's pieces, each made once: the config, where it runs, its run directory, its
    plan and the config as resolved by it, and whether it resumes."""

    cfg: RaytrainConfig
    command: Command
    address: str | None
    local: bool  # Ray Train's local mode: in this process, or torchrun's
    env: Environment  # this machine; once connected, what the run plans against
    run_dir: RunDirectory
    # One of torchrun's other processes: rank 0 checks, prepares and records the run.
    follower: bool = False
    plan: Any = None  # set by ``connected``
    resolved: RaytrainConfig | None = None  # likewise
    resuming: bool = False  # set by ``lease``

    @classmethod
    def checked(
        cls,
        cfg: RaytrainConfig,
        command: Command,
        *,
        address: str | None = None,
        local: bool = False,
    ) -> Launch:
        """The launch of ``cfg``, with every check that needs no Ray done.

        Raises:
            BadInputError: the config, its sources or its run directory are refused.
        """
        if local and address:
            raise BadInputError("local=True runs without a Ray cluster; pass no address")
        if local:  # planned for the processes local mode has: this one, or torchrun's
            cfg = local_processes_config(cfg)
        follower = local and bool(torchrun_rank())
        if not follower:  # rank 0 (or the only process) checks for all
            check_tracking_installed(cfg)
            check_sources(cfg.model, cfg.data)  # a wrong target or data path fails before Ray
        launch = cls(
            cfg=cfg,
            command=command,
            address=address,
            local=local,
            env=detect_environment(),
            run_dir=_run_dir(cfg),
            follower=follower,
        )
        if follower:
            return launch
        known = launch._config_known_before_ray()
        if known is not None:
            launch.run_dir.check_resumable(known)
            launch.cfg = _streaming_decided(cfg, known)
        # Nothing is written to look; the lease itself is taken in ``lease``.
        refuse_if_held(launch.run_dir.location.uri, command.name)
        return launch

    def _config_known_before_ray(self) -> RaytrainConfig | None:
        """The config the run directory will hold, where it is known before Ray starts:
        planned against this machine when Ray will run here (which fails fast on bad input;
        a cluster is planned against once connected)."""
        ray_here = not (self.local or self.address or self.env.ray_address)
        # Ray may be starting here already, beside these checks (embedded_ray_beside).
        if ray_here and (embedded_ray_starting() or not ray.is_initialized()):
            return self.command.plan(self.cfg, self.env)[1]
        return None if self.command.resolves_config else self.cfg

    @contextlib.contextmanager
    def connected(self) -> Iterator[Launch]:
        """Connect to Ray, or not in local mode; plan against what it offers while the body
        runs (a Ray started here ends with it)."""
        if self.command.ray_train:
            apply_ray_train_defaults()
        session = (
            contextlib.nullcontext(self.env) if self.local else ray_session(self.address, self.env)
        )
        with session as self.env:
            self.plan, self.resolved = self.command.plan(self.cfg, self.env)
            location = self.run_dir.location
            # An object store is the same store on every node; local mode runs on this one.
            if location.is_local and not self.local:
                check_shared(location.local_path.parent, self.resolved.experiment.output_dir)
            self.run_dir.check_resumable(self.resolved)
            yield self

    @contextlib.contextmanager
    def lease(self) -> Iterator[Launch]:
        """Hold the run directory's lease while the body runs: one writer at a time; a run
        that loses it stops its workers and fails (exit 1) without writing more."""
        with hold_run_lease(self.run_dir.location.uri, self.command.name):
            # Again under the lease: of two runs that both passed the checks, one gets here.
            self.resuming = self.run_dir.check_resumable(self.resolved)
            yield self


def _streaming_decided(cfg: RaytrainConfig, known: RaytrainConfig) -> RaytrainConfig:
    """``cfg`` with ``data.streaming: auto`` as the plan before Ray decided it: that took a
    listing of ``data.path`` (a bucket may hold many files), and the plan made again once
    connected would otherwise list it again for the same answer."""
    if cfg.data.streaming != "auto" or known.data.streaming == "auto":
        return cfg
    decided = cfg.model_copy(deep=True)
    decided.data.streaming = known.data.streaming
    return decided


def _run_dir(cfg: RaytrainConfig) -> RunDirectory:
    # The plan changes neither experiment.name nor output_dir: this is the run's directory.
    return RunDirectory.for_config(cfg)
