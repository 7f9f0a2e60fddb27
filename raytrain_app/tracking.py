"""Experiment tracking: TensorBoard, MLflow and W&B behind one ``Tracker``, and ``loss.png``.

Only rank 0 tracks (``open_tracker`` gives every other rank a tracker that does nothing).
Every backend uses the global optimizer step as its x-axis: step scalars (rank 0's batch
loss, the lr) every ``tracking.log_every_steps`` steps, and the epoch row at each epoch's
last step. A resumed run continues the same MLflow / W&B run; TensorBoard gets a new event
file whose ``purge_step`` makes TensorBoard drop what the previous segment logged after
the checkpoint, so redone steps and epochs appear once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raytrain_app.config import RaytrainConfig, config_to_dict, flatten
from raytrain_app.errors import BadInputError

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
WANDB_DIR = "wandb"  # created by wandb.init(dir=<run dir>)
LOSS_PLOT_FILE = "loss.png"
_IDS_FILE = ".tracking.json"  # MLflow / W&B run ids, so a resume continues the same run

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


def enabled_outputs(cfg: RaytrainConfig) -> list[str]:
    """The tracking outputs a run writes besides metrics.csv, for the plan printout."""
    t = cfg.tracking
    names = {"tensorboard": t.tensorboard, "mlflow": t.mlflow, "wandb": t.wandb}
    return [name for name, on in names.items() if on] + (["loss.png"] if t.loss_plot else [])


class Tracker:
    """The interface every backend implements; this base does nothing (ranks other than 0)."""

    log_every_steps = 0

    def due(self, step: int) -> bool:
        """Whether step scalars of optimizer ``step`` should be logged (cheap check first)."""
        return bool(self.log_every_steps) and step % self.log_every_steps == 0

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        """Per-step scalars (``loss``, ``lr``) at optimizer ``step``."""

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        """One epoch's row (the metrics.csv columns) at the epoch's last optimizer ``step``."""

    def close(self, failed: bool = False) -> None:
        """Flush and end the run; ``failed`` marks it as such where the backend can."""


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in row.items()
        if key not in ("epoch", "step") and isinstance(value, int | float)
    }


class TensorBoardTracker(Tracker):
    """Event files under ``<run dir>/tensorboard`` through tensorboardX (comes with Ray)."""

    def __init__(self, logdir: Path, resumed_step: int) -> None:
        from tensorboardX import SummaryWriter

        # TensorBoard drops events at or after purge_step from the earlier event files.
        purge = resumed_step + 1 if resumed_step else None
        self.writer = SummaryWriter(
            logdir=str(logdir),
            purge_step=purge,
            flush_secs=30,
            filename_suffix=f".step{resumed_step}",  # one file per run segment
        )

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"step/{key}", value, step)

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(f"epoch/{key}", value, step)
        self.writer.flush()  # an epoch is never lost to a crash between flushes

    def close(self, failed: bool = False) -> None:
        self.writer.close()


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
        self._log(step, _scalars(row))

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbTracker(Tracker):
    """A W&B run in offline mode under ``<run dir>/wandb``; ``wandb sync`` uploads it."""

    def __init__(
        self, run_dir: Path, project: str, name: str, params: dict, run_id: str | None
    ) -> None:
        import wandb

        self.run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project=project,
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            config=params,
            settings=wandb.Settings(console="off", silent=True, disable_git=True),
        )
        self.run_id = self.run.id

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({f"step/{key}": value for key, value in scalars.items()}, step=step)

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log({f"epoch/{key}": value for key, value in _scalars(row).items()}, step=step)

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() returns before W&B's service has written the offline file; shutting the
        # service down waits for it (this process may exit right after training).
        wandb.teardown()


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
    ids_path = run_dir / _IDS_FILE
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


def loss_figure(rows: Sequence[Mapping[str, float]]) -> Any:
    """A matplotlib Figure of train and val loss per epoch (no pyplot: no global backend)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4), dpi=100, layout="tight")
    axes = figure.add_subplot()
    epochs = [row["epoch"] for row in rows]
    for key in ("train_loss", "val_loss"):
        axes.plot(epochs, [row.get(key, math.nan) for row in rows], marker="o", label=key)
    axes.set_xlabel("epoch")
    axes.set_ylabel("loss")
    axes.legend()
    axes.grid(alpha=0.3)
    return figure


def write_loss_plot(run_dir: Path, rows: Sequence[Mapping[str, float]]) -> Path | None:
    """Draw ``loss.png`` in ``run_dir``; without matplotlib, log how to get it and return None.

    The PNG's Description text chunk holds the plotted epochs and losses as JSON.
    """
    if not rows:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        logger.info(
            "no %s: matplotlib is not installed; pip install 'raytrain_app[plot]' to get the "
            "loss plot (or set tracking.loss_plot=false)",
            LOSS_PLOT_FILE,
        )
        return None
    path = Path(run_dir) / LOSS_PLOT_FILE
    data = {k: [row.get(k) for row in rows] for k in ("epoch", "train_loss", "val_loss")}
    tmp = path.with_name(LOSS_PLOT_FILE + ".tmp")
    try:
        loss_figure(rows).savefig(tmp, format="png", metadata={"Description": json.dumps(data)})
        os.replace(tmp, path)
    except Exception as exc:  # the run itself succeeded: never fail it over a plot
        logger.warning("could not draw %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return None
    return path


def read_tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """The scalars of a run's event files as TensorBoard shows them: ``{tag: {step: value}}``.

    Files are read in order; a session start with a step (tensorboardX's ``purge_step``)
    drops the values logged at or after that step before it, as TensorBoard does.
    """
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset + 12 <= len(data):  # TFRecord: length, crc, payload, crc
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            if event.session_log.status == SessionLog.START and event.step:
                for values in scalars.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars
