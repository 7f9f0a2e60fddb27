"""``train.monitor`` / ``train.mode``: which checkpoint is the best one.

Ray Train keeps the ``train.keep_checkpoints`` best checkpoints by a reported score plus
always the newest one (``CheckpointManager`` never deletes its latest checkpoint), so a
resume always finds the newest. The score is a finite number under its own key: mid-epoch
checkpoints have no epoch metrics, and Ray persists NaN and infinities as ``null``, which
it then cannot order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_app.checkpoint.store import META_FILE, MODEL_FILE, checkpoints_newest_first, read_meta
from raytrain_app.config import TrainConfig
from raytrain_app.errors import BadInputError
from raytrain_app.storage import StorageLocation

# A folder of checkpoints: a local path, or a location in the run's storage.
Folder = Path | StorageLocation

# The reported key Ray's CheckpointConfig ranks checkpoints by (larger is better).
SCORE_KEY = "checkpoint_score"
# Below every real score: mid-epoch checkpoints and non-finite metrics, kept only as newest.
WORST_SCORE = -1.0e300


class UnknownMonitorError(BadInputError):
    """``train.monitor`` names a metric the run does not report."""


def checkpoint_score(metrics: Mapping[str, Any], monitor: str, mode: str) -> float:
    """The score Ray ranks a checkpoint by: the monitored value, negated for ``min``."""
    value = metrics.get(monitor)
    if metrics.get("mid_epoch") or not isinstance(value, int | float) or not math.isfinite(value):
        return WORST_SCORE
    return float(value) if mode == "max" else -float(value)


def checkpoint_retention(train: TrainConfig) -> dict[str, Any]:
    """The one retention rule of Train runs and Tune trials alike, as ``CheckpointConfig``
    arguments: the ``train.keep_checkpoints`` best by ``SCORE_KEY`` (Ray keeps the newest
    as well)."""
    return {
        "num_to_keep": train.keep_checkpoints,
        "checkpoint_score_attribute": SCORE_KEY,
        "checkpoint_score_order": "max",
    }


def epoch_metric_names(step_metrics: Sequence[str]) -> list[str]:
    """The monitorable columns of an epoch row, given the metrics a step returns."""
    return [f"{split}_{name}" for split in ("train", "val") for name in ("loss", *step_metrics)]


def check_monitor(monitor: str, step_metrics: Sequence[str]) -> None:
    """Raise a one-line error when ``monitor`` is not among the run's epoch metrics."""
    available = epoch_metric_names(step_metrics)
    if monitor not in available:
        raise UnknownMonitorError(
            f"train.monitor={monitor!r} is not a metric this run reports; set train.monitor to "
            f"one of {', '.join(available)}"
        )


@dataclass(frozen=True)
class BestCheckpoint:
    """The best kept checkpoint of a run and what made it the best."""

    path: Path | str  # a local path, or the URI of a checkpoint in an object store
    monitor: str
    mode: str
    value: float
    epoch: int

    def to_summary(self) -> dict[str, Any]:
        return {"metric": self.monitor, "mode": self.mode, "value": self.value, "epoch": self.epoch}


def metas_newest_first(folder: Folder) -> Iterator[tuple[Path | str, dict[str, Any] | None]]:
    """Every checkpoint under ``folder`` (any depth), newest progress first, with its
    ``meta.json`` (None when unreadable): local paths, or URIs of checkpoints in an object
    store, whose metadata is read there without downloading any weights."""
    if isinstance(folder, StorageLocation) and not folder.is_local:
        yield from _remote_metas_newest_first(folder)
        return
    local = folder.local_path if isinstance(folder, StorageLocation) else Path(folder)
    for directory in checkpoints_newest_first(local):
        try:
            yield directory, read_meta(directory)
        except (OSError, ValueError):
            yield directory, None


def _remote_metas_newest_first(folder: StorageLocation) -> list[tuple[str, dict | None]]:
    """``metas_newest_first`` in an object store: one listing, then each meta.json; ordered
    by the (epoch, step) in the metadata, a step written again (``-r1``) after the first."""
    found = []
    for item in folder.list_dir(recursive=True, files_only=True):
        parent = item.path.rsplit("/", 1)[0]
        if item.name != MODEL_FILE or ".partial" in parent.rsplit("/", 1)[-1]:
            continue
        directory = folder.at(parent)
        try:
            meta = json.loads(directory.child(META_FILE).read_text())
            progress = (int(meta["epoch"]), int(meta["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            meta, progress = None, (-1, -1)
        found.append((progress, directory.name, directory.uri, meta))
    found.sort(key=lambda entry: entry[:2], reverse=True)
    return [(uri, meta) for _, _, uri, meta in found]


def best_checkpoint(folder: Folder, monitor: str, mode: str) -> BestCheckpoint | None:
    """The epoch checkpoint under ``folder`` with the best finite ``monitor``; ties: newest.

    Reads each checkpoint's ``meta.json`` (its epoch row), so it works on any run
    directory, finished or not. None when no epoch checkpoint has the metric.
    """
    best: BestCheckpoint | None = None
    for directory, meta in metas_newest_first(folder):
        if meta is None:
            continue
        metrics = meta.get("metrics", {})
        score = checkpoint_score(metrics, monitor, mode)
        if score == WORST_SCORE:
            continue
        if best is None or score > checkpoint_score({monitor: best.value}, monitor, mode):
            best = BestCheckpoint(directory, monitor, mode, metrics[monitor], metrics["epoch"])
    return best


def check_monitor_on_one_batch(
    monitor: str, spec: Any, dataset: Any, collate: Callable[[list[Any]], Any] | None = None
) -> None:
    """Check ``monitor`` on the driver, before any worker starts, by running one tiny batch
    (made by the workload's ``collate``, torch's default without one).

    train_loss and val_loss always exist; other metrics are known only once the model's
    step ran (and its ``metrics_from_counts``, for metrics made of counts). A step that
    cannot run here (e.g. a GPU-only model) leaves the check to the workers, which make it
    after their first step (or epoch).
    """
    if monitor in ("train_loss", "val_loss") or len(dataset) == 0:
        return
    import torch
    from torch.utils.data import default_collate

    from raytrain_app.protocol import check_counts_hook, counted_metrics

    try:
        batch = (collate or default_collate)([dataset[i] for i in range(min(2, len(dataset)))])
        spec.module.eval()
        with torch.no_grad():
            out = spec.step(spec.module, batch)
        names = list(out.metrics)
        check_counts_hook(spec, out.counts)
        if getattr(spec, "metrics_from_counts", None) is not None and out.counts:
            totals = {key: value.detach().double().cpu() for key, value in out.counts.items()}
            names += list(counted_metrics(spec, totals, names))
    except BadInputError:
        raise
    except Exception:
        return
    check_monitor(monitor, names)


def best_of_run(folder: Folder) -> BestCheckpoint | None:
    """``best_checkpoint`` by the monitor and mode the run was trained with (its newest meta)."""
    for _, meta in metas_newest_first(folder):
        try:
            train = meta["config"]["train"]
        except (KeyError, TypeError):
            continue
        monitor = train.get("monitor", "val_loss") if isinstance(train, dict) else None
        mode = train.get("mode", "min") if isinstance(train, dict) else None
        if not isinstance(monitor, str) or mode not in ("min", "max"):
            continue  # meta.json was edited: choose by the newest instead
        return best_checkpoint(folder, monitor, mode)
    return None
