"""The run's trackers: every enabled backend on rank 0 behind one ``Tracker``.

Only rank 0 tracks (``open_tracker`` gives every other rank a tracker that does nothing). A
backend that cannot start or fails later is switched off with a warning; the run goes on.
A Tune trial tracks like a run of its own, named after the trial and gathered by its sweep
(``SweepTrial``): one MLflow experiment and one W&B group per sweep.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_app.config import RaytrainConfig, config_to_dict, flatten
from raytrain_app.errors import BadInputError
from raytrain_app.tracking.base import Tracker
from raytrain_app.tracking.mlflow_tracker import (
    MLFLOW_DIR,
    MlflowTracker,
    experiment_id,
    mlflow_client,
)
from raytrain_app.tracking.tensorboard_tracker import TENSORBOARD_DIR, TensorBoardTracker
from raytrain_app.tracking.wandb_tracker import WandbTracker

logger = logging.getLogger(__name__)

IDS_FILE = ".tracking.json"  # MLflow / W&B run ids, so a resume continues the same run


# backend key -> (module to import, pip extra that installs it)
_OPTIONAL_BACKENDS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


def check_tracking_installed(cfg: RaytrainConfig) -> None:
    """Fail before Ray starts when an enabled backend's package is missing (exit code 2)."""
    for key, (module, extra) in _OPTIONAL_BACKENDS.items():
        if getattr(cfg.tracking, key) and importlib.util.find_spec(module) is None:
            raise BadInputError(
                f"tracking.{key}=true needs the {module} package; install it with "
                f"pip install 'raytrain_app[{extra}]' or set tracking.{key}=false"
            )


@dataclass(frozen=True)
class SweepTrial:
    """The sweep a Tune trial belongs to: what its tracked run is named and gathered under.

    Args:
        sweep: the sweep's ``experiment.name``: its MLflow experiment and W&B group.
        trial_id: Tune's trial id (its folder under ``trials/``): the run's name.
        mlflow_store: the MLflow file store the sweep's trials share (``<sweep dir>/mlruns``),
            or None for a store in the trial's own folder (a sweep in an object store).
    """

    sweep: str
    trial_id: str
    mlflow_store: str | None = None


def mlflow_store_uri(cfg: RaytrainConfig, run_dir: Path, trial: SweepTrial | None = None) -> str:
    """Where MLflow logs: ``tracking.mlflow_tracking_uri``, else the sweep's file store,
    else a file store in the run directory."""
    if cfg.tracking.mlflow_tracking_uri:
        return cfg.tracking.mlflow_tracking_uri
    if trial is not None and trial.mlflow_store:
        return trial.mlflow_store
    return (Path(run_dir) / MLFLOW_DIR).as_uri()


def prepare_sweep_tracking(cfg: RaytrainConfig, sweep_dir: Path | None) -> str | None:
    """On the driver, before any trial starts: the MLflow file store the sweep's trials
    share, its experiment created once here (trials creating it at once would make
    several in a file store, and all but one would fail on a server).

    Args:
        sweep_dir: the sweep's directory, or None for one in an object store (MLflow writes
            no file store there: each trial keeps one in its own folder, uploaded with it).

    Returns:
        ``<sweep dir>/mlruns`` as a URI for ``SweepTrial.mlflow_store``; None without MLflow
        or without a local sweep directory.
    """
    if not cfg.tracking.mlflow:
        return None
    store = (Path(sweep_dir) / MLFLOW_DIR).as_uri() if sweep_dir is not None else None
    uri = cfg.tracking.mlflow_tracking_uri or store
    if uri is not None:
        try:
            experiment_id(mlflow_client(uri), cfg.experiment.name)
        except Exception as exc:  # the trials try again and track without it if they fail
            logger.warning(
                "could not create the MLflow experiment %r at %s: %s", cfg.experiment.name, uri, exc
            )
    return store


class _Fanout(Tracker):
    """Several backends as one; a backend that fails is dropped with a warning, not the run."""

    def __init__(self, trackers: Sequence[Tracker], log_every_steps: int) -> None:
        self.trackers = list(trackers)
        self.log_every_steps = log_every_steps if trackers else 0

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:
                logger.warning(
                    "tracking with %s failed and is switched off for this run: %s",
                    type(tracker).__name__,
                    exc,
                )
                self.trackers.remove(tracker)

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        self._each("log_step", step, scalars)

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        self._each("log_epoch", step, row)

    def close(self, failed: bool = False) -> None:
        self._each("close", failed)
        self.trackers = []


def open_tracker(
    cfg: RaytrainConfig,
    run_dir: Path,
    resumed_step: int,
    rank_zero: bool,
    trial: SweepTrial | None = None,
) -> Tracker:
    """The run's tracker: every enabled backend on rank 0, nothing on other ranks.

    The MLflow and W&B run ids are kept in ``run_dir`` (``IDS_FILE``): a resumed run, or a
    trial that Tune pauses and resumes, continues its own runs. ``trial``: the run is this
    Tune trial of a sweep.
    """
    t = cfg.tracking
    if not rank_zero or not (t.tensorboard or t.mlflow or t.wandb):
        return Tracker()
    run_dir = Path(run_dir)
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    params = config_to_dict(cfg)
    run_name = trial.trial_id if trial else cfg.experiment.name
    group = trial.sweep if trial else None
    backends = {
        "tensorboard": lambda: TensorBoardTracker(run_dir / TENSORBOARD_DIR, resumed_step),
        "mlflow": lambda: MlflowTracker(
            mlflow_store_uri(cfg, run_dir, trial),
            cfg.experiment.name,
            run_name,
            flatten(params),
            ids.get("mlflow"),
        ),
        "wandb": lambda: WandbTracker(
            run_dir, t.wandb_project, run_name, params, ids.get("wandb"), group=group
        ),
    }
    trackers: list[Tracker] = []
    for name, start in backends.items():
        if not getattr(t, name):
            continue
        try:
            tracker = start()
        except Exception as exc:  # e.g. an unreachable MLflow server: train without it
            logger.warning(
                "tracking with %s could not start and is off for this run: %s", name, exc
            )
            continue
        trackers.append(tracker)
        if name != "tensorboard":
            ids[name] = tracker.run_id
    if ids:
        ids_path.write_text(json.dumps(ids))
    return _Fanout(trackers, t.log_every_steps)
