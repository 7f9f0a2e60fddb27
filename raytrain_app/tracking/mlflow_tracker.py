"""An MLflow run, by default in a file store under ``<run dir>/mlruns`` (a sweep's trials:
``<sweep dir>/mlruns``, one experiment); a resumed run continues the same MLflow run."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from raytrain_app.tracking.base import Tracker, epoch_scalars

MLFLOW_DIR = "mlruns"


def mlflow_client(uri: str) -> Any:
    """MLflow's client of ``uri``; a ``file:`` URI is a file store (MLflow 3 opens one only
    when asked: a folder in the run directory is exactly what we want here, no database,
    and it works on shared filesystems)."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment ``name``, created if there is none yet."""
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found else client.create_experiment(name)


def _restore_empty_folders(store: Path, run_id: str) -> None:
    """Put back the empty folders a file store's run needs: an object store keeps none, so a
    store staged back from one (a resume of a run in a bucket) lacks them, and MLflow would
    not find the run."""
    for run_dir in store.glob(f"*/{run_id}"):
        for folder in ("metrics", "params", "artifacts", "tags"):
            (run_dir / folder).mkdir(exist_ok=True)


class MlflowTracker(Tracker):
    """An MLflow run in experiment ``experiment`` of the store at ``uri``.

    Args:
        uri: the tracking URI: a server, a database or a ``file:`` store.
        experiment: the run's experiment (the run's, or its sweep's, ``experiment.name``).
        run_name: the run's name (the experiment name, or a sweep trial's id).
        params: flat config keys and values, logged when the run is created.
        run_id: the run to continue (a resume), or None for a new one.
    """

    def __init__(
        self, uri: str, experiment: str, run_name: str, params: dict, run_id: str | None
    ) -> None:
        self.client = mlflow_client(uri)
        if run_id is None:
            created = self.client.create_run(
                experiment_id(self.client, experiment), run_name=run_name
            )
            run_id = created.info.run_id
            self._log_params(run_id, params)
        else:
            if uri.startswith("file:"):
                _restore_empty_folders(Path(url2pathname(urlparse(uri).path)), run_id)
            # A continued run is running again (its last segment ended it FINISHED or FAILED).
            self.client.update_run(run_id, status="RUNNING")
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
