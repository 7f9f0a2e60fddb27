"""A worker in Ray Train's local mode (``ScalingConfig(num_workers=0)``).

The training function runs in the calling process, alone or as one of torchrun's
processes, with the same ``ray.train`` context (rank, world size, device,
``prepare_model``) and no Ray cluster at all: nothing to start, and a ``breakpoint()`` in a
model's step stops in the user's terminal.

Ray Train keeps no storage in local mode (a report stays in memory), so this session puts
each checkpoint into the run's storage itself, with the upload, names and retention of a
Ray run: a later run of the same run directory on Ray resumes from it, and the other way
round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_app.checkpoint.ranking import checkpoint_score, metas_newest_first
from raytrain_app.checkpoint.upload import save_atomically
from raytrain_app.storage import StorageLocation
from raytrain_app.worker.loop import WorkerLoop
from raytrain_app.worker.session import (
    RayTrainSession,
    checkpoint_directory,
    newest_persisted,
    persist_shards,
)


@dataclass(frozen=True)
class RunStorage:
    """What the checkpoint uploads and the resume use of Ray Train's ``StorageContext``:
    the folder that holds the run's checkpoints (``<storage_path>/<experiment name>``)."""

    storage_filesystem: Any
    experiment_fs_path: str

    def build_checkpoint_path_from_name(self, name: str) -> str:
        return f"{self.experiment_fs_path}/{name}"


@dataclass(frozen=True)
class Retention:
    """Ray Train's rule (``ranking.checkpoint_retention``): the ``keep`` best by the
    monitored metric, and always the newest. ``keep`` None keeps every checkpoint."""

    keep: int | None
    monitor: str
    mode: str


class LocalModeSession(RayTrainSession):
    """``RayTrainSession`` where Ray Train keeps no storage: checkpoints are persisted and
    pruned here, and a resume looks in the run's storage.

    Args:
        checkpoints: the run's checkpoint folder for this experiment, as a Ray run's
            ``storage_path/name`` (a local path or an object-store URI).
    """

    def __init__(self, checkpoints: str, retention: Retention) -> None:
        super().__init__()
        self.folder = StorageLocation.parse(checkpoints, "experiment.output_dir")
        self.storage = RunStorage(self.folder.filesystem, self.folder.path)
        self.retention = retention

    def report(self, metrics: dict[str, Any], saved: Future | None, name: str | None) -> None:
        import ray.train

        # Ray's local mode keeps the last report: the run's result, as on a cluster. Its
        # checkpoint is the newest in the run's storage (driver.local_run), where the
        # writer puts this one (``persist``).
        ray.train.report(metrics, checkpoint_dir_name=name)

    def persist(self, write: Callable[[Path], Any], name: str, group: Any) -> Any:
        if group is None or self.world_size == 1:
            persisted = save_atomically(write, name, storage=self.storage)
        else:
            persisted = persist_shards(write, name, group, storage=self.storage)
        if self.world_rank == 0:
            self._prune()
        return persisted

    def restored_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        return checkpoint_directory(newest_persisted(None, storage=self.storage))

    def _prune(self) -> None:
        """Delete what Ray Train's ``CheckpointManager`` would: all but the best ``keep``
        and the newest (whatever run wrote them: local or on Ray)."""
        rule = self.retention
        if rule.keep is None:
            return
        found = [(where, meta) for where, meta in metas_newest_first(self.folder) if meta]
        if not found:
            return
        newest, older = found[0], found[1:]

        def score(entry: tuple[Any, dict[str, Any]]) -> float:
            return checkpoint_score(entry[1].get("metrics", {}), rule.monitor, rule.mode)

        # Best first; among equal scores the newer (older is already newest first).
        ranked = sorted(found, key=score, reverse=True)
        kept = {str(where) for where, _ in ranked[: rule.keep]} | {str(newest[0])}
        for where, _ in older:
            if str(where) not in kept:
                self._location(where).delete()

    def _location(self, where: Path | str) -> StorageLocation:
        if isinstance(where, Path):
            return StorageLocation.local(where)
        return StorageLocation.parse(where, "experiment.output_dir")


def train_worker_local(task: Any, checkpoints: str, retention: Retention) -> dict[str, Any]:
    """Ray Train local mode's training function: the same loop as ``train_worker``."""
    return WorkerLoop(task, LocalModeSession(checkpoints, retention)).run()
