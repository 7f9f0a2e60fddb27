"""``train()``: the steps of ``raytrain train`` on the driver, top to bottom.

1. ``Launch.checked`` (``driver/launch.py``): the checks that need no Ray, the run
   directory, the plan against this machine when Ray would start here (while it starts:
   ``raytrain_app.train`` begins an embedded Ray's start before importing this module).
2. ``Launch.connected``: Ray connected or started (local mode: none), the plan made
   against its resources, the run directory checked against the resolved config.
3. ``Launch.lease``: one writer per run directory.
4. ``run_training`` (``driver/executors.py``): the workload checked once on the driver,
   ``config.yaml`` written, the workers run by a ``TorchTrainer`` or in local mode.
5. ``record_run`` (``driver/run_summary.py``): ``summary.json`` and ``loss.png``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.executors import follow_rank_zero, run_training
from raytrain_app.driver.launch import Command, Launch
from raytrain_app.driver.run_summary import record_run
from raytrain_app.errors import RunStoppedError
from raytrain_app.planning.environment import Environment
from raytrain_app.planning.rules import TrainingPlan, make_plan, resolve_config
from raytrain_app.storage import is_uri
from raytrain_app.workloads import resolve_streaming


@dataclass
class TrainResult:
    """What ``train`` returns: where the run lives and how it ended.

    Paths are local ``Path``s, or URI strings for a run directory in an object store.
    """

    run_dir: Path | str
    summary: dict[str, Any]
    metrics: list[dict[str, float]] = field(default_factory=list)

    @property
    def checkpoint(self) -> Path | str:
        """The newest checkpoint (what a resume continues from)."""
        return _path_or_uri(self.summary["checkpoint"])

    @property
    def best_checkpoint(self) -> Path | str | None:
        """The best checkpoint by train.monitor / train.mode (what inference should use)."""
        best = self.summary.get("best_checkpoint")
        return _path_or_uri(best) if best else None


def _path_or_uri(text: str) -> Path | str:
    return text if is_uri(text) else Path(text)


def plan_training(cfg: RaytrainConfig, env: Environment) -> tuple[TrainingPlan, RaytrainConfig]:
    """The run's plan against ``env``, and the config with the plan's choices and whether
    the data streams: a resume must not switch between streaming and loading the data
    (their orders differ)."""
    cfg = resolve_streaming(cfg)  # first: streaming data limits the workers auto picks
    plan = make_plan(cfg, env)
    return plan, resolve_config(cfg, plan)


TRAIN = Command("train", plan_training, resolves_config=True, ray_train=True)


def train(
    cfg: RaytrainConfig,
    *,
    address: str | None = None,
    progress: bool = True,
    local: bool = False,
    began_at: float | None = None,
) -> TrainResult | None:
    """Train ``cfg`` with DDP on Ray; resumes the run of the same name and config if any.

    ``local``: in Ray Train's local mode, in this process (``driver.local_run``); under
    torchrun, in each of its processes, of which only rank 0 returns a result (the others
    return None). ``began_at``: when the run began (wall clock; ``run_clock``), from which
    its wall time and goodput's start-up count; this call by default.

    Raises:
        BadInputError: the config, data or model is invalid (nothing was written).
        RunFailedError: the run started and failed.
    """
    # the perf counter's reading at began_at: wall time measured on a monotonic clock
    start = time.perf_counter() - (time.time() - began_at if began_at is not None else 0.0)
    launch = Launch.checked(cfg, TRAIN, address=address, local=local)
    if launch.follower:  # one of torchrun's other processes: rank 0 returns the result
        follow_rank_zero(launch)
        return None
    with launch.connected(), launch.lease():
        result, stop_signal = run_training(launch, progress)
        summary, metrics = record_run(launch, result, time.perf_counter() - start)
    if summary["status"] == "stopped":
        raise RunStoppedError(
            f"stopped on request ({stop_signal}) after {summary['epochs_completed']} complete "
            f"epoch(s), with a checkpoint at {summary['checkpoint']}; run the same command "
            f"again to resume",
            interrupted=stop_signal == "SIGINT",
        )
    location = launch.run_dir.location
    run_path = location.local_path if location.is_local else location.uri
    return TrainResult(run_dir=run_path, summary=summary, metrics=metrics)
