"""The run's trackers: every enabled backend on rank 0 behind one ``Tracker``.

Only rank 0 tracks (``open_tracker`` gives every other rank a tracker that does nothing). A
backend that cannot start or fails later is switched off with a warning; the run goes on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raytrain_app.config import RaytrainConfig, config_to_dict, flatten
from raytrain_app.errors import BadInputError
from raytrain_app.tracking.base import Tracker
from raytrain_app.tracking.mlflow_tracker import MlflowTracker
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


def open_tracker(cfg: RaytrainConfig, run_dir: Path, resumed_step: int, rank_zero: bool) -> Tracker:
    """The run's tracker: every enabled backend on rank 0, nothing on other ranks."""
    t = cfg.tracking
    if not rank_zero or not (t.tensorboard or t.mlflow or t.wandb):
        return Tracker()
    run_dir = Path(run_dir)
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    params = config_to_dict(cfg)
    backends = {
        "tensorboard": lambda: TensorBoardTracker(run_dir / TENSORBOARD_DIR, resumed_step),
        "mlflow": lambda: MlflowTracker(
            run_dir, t.mlflow_tracking_uri, cfg.experiment.name, flatten(params), ids.get("mlflow")
        ),
        "wandb": lambda: WandbTracker(
            run_dir, t.wandb_project, cfg.experiment.name, params, ids.get("wandb")
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
