"""Rank 0's files of the run directory, written where appends and in-place updates work.

``metrics.csv``, ``tensorboard/``, ``mlruns/``, ``wandb/`` and ``.tracking.json`` are written
in place (appended rows, event files, MLflow's file store). For a local run directory
(one on a shared filesystem too) rank 0 writes them there directly. For a run directory in
an object store it writes them in a node-local staging folder, filled first from the store
(a resumed run may land on another node) and uploaded after every epoch and at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from raytrain_app.storage import StagingDirectory, StorageLocation
from raytrain_app.tracking.base import Tracker
from raytrain_app.tracking.metrics_log import METRICS_FILE
from raytrain_app.tracking.mlflow_tracker import MLFLOW_DIR
from raytrain_app.tracking.tensorboard_tracker import TENSORBOARD_DIR
from raytrain_app.tracking.trackers import IDS_FILE

logger = logging.getLogger(__name__)

WANDB_DIR = "wandb"
RANK_ZERO_ENTRIES = (METRICS_FILE, TENSORBOARD_DIR, MLFLOW_DIR, WANDB_DIR, IDS_FILE)


class RankZeroFiles:
    """Where rank 0 writes its files (``local``), and their way into the run's storage.

    Args:
        run_dir: the run directory (or a Tune trial's folder): a local path or a URI.
        rank_zero: only rank 0 writes; other ranks get no folder (``local`` is None).
    """

    def __init__(self, run_dir: str, rank_zero: bool) -> None:
        self._staging: StagingDirectory | None = None
        self.local: Path | None = None
        if rank_zero:
            location = StorageLocation.parse(run_dir, "experiment.output_dir")
            self._staging = StagingDirectory(location, RANK_ZERO_ENTRIES)
            self.local = self._staging.local

    def tracked(self, tracker: Tracker) -> Tracker:
        """``tracker``, uploading the files after every epoch and when it closes."""
        if self._staging is None:
            return tracker
        return _Uploading(tracker, self._staging)


class _Uploading(Tracker):
    """A tracker whose epoch rows and close also put rank 0's files into storage."""

    def __init__(self, inner: Tracker, staging: StagingDirectory) -> None:
        self.inner = inner
        self.staging = staging
        self.log_every_steps = inner.log_every_steps

    def due(self, step: int) -> bool:
        return self.inner.due(step)

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        self.inner.log_step(step, scalars)

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        self.inner.log_epoch(step, row)
        try:
            self.staging.sync()
        except OSError as exc:  # the store may be back by the next epoch; the end retries
            logger.warning("could not upload the run's files to %s: %s", self.staging.location, exc)

    def close(self, failed: bool = False) -> None:
        try:
            self.inner.close(failed)
        finally:
            self.staging.close()
