"""An MLflow run, by default in a file store under ``<run dir>/mlruns``; a resumed run
continues the same MLflow run."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

from raytrain_app.tracking.base import Tracker, epoch_scalars

MLFLOW_DIR = "mlruns"


class MlflowTracker(Tracker):
    """An MLflow run; by default in a file store under ``<run dir>/mlruns``."""

    def __init__(
        self, run_dir: Path, uri: str | None, experiment: str, params: dict, run_id: str | None
    ) -> None:
        from mlflow.tracking import MlflowClient

        if uri is None:
            # MLflow 3 refuses its file store unless asked: a folder in the run directory is
            # exactly what we want here (no database, works on shared filesystems).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / MLFLOW_DIR).as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id if found else self.client.create_experiment(experiment)
            )
            run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
            self._log_params(run_id, params)
        self.run_id = run_id

    def _log_params(self, run_id: str, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(key, str(value)[:500]) for key, value in sorted(params.items())]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 per batch
            self.client.log_batch(run_id, params=items[start : start + 100])

    def _log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items() if math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        self._log(step, {f"step_{key}": value for key, value in scalars.items()})

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        self._log(step, epoch_scalars(row))

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
