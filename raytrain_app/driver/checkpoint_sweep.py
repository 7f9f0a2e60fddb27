"""Checkpoints Ray never recorded, removed at the run's end as Ray's retention would have.

A save finishes in the background: a worker group that fails while one is in flight can
leave that checkpoint complete in the run's storage without Ray ever registering it (and
a writer killed mid-save leaves its ``<name>.partial``). The next attempt may resume from
it (``worker.session.newest_persisted``), but Ray's ``train.keep_checkpoints`` retention
deletes only what it recorded, so it would stay forever. At the run's end the driver
removes, under the run's lease, every ``.partial`` and every unrecorded checkpoint that
Ray's retention would have dropped: older than Ray's newest, ranked last by the monitor
(a mid-epoch one), while Ray kept ``keep_checkpoints`` others.
"""

from __future__ import annotations

import json
import logging
from pathlib import PurePosixPath
from typing import Any

from raytrain_app.checkpoint.ranking import WORST_SCORE, checkpoint_score
from raytrain_app.checkpoint.store import META_FILE, name_progress
from raytrain_app.storage import StorageLocation

logger = logging.getLogger(__name__)


def remove_unrecorded_checkpoints(
    checkpoints: StorageLocation, result: Any, keep: int | None, monitor: str, mode: str
) -> list[str]:
    """Delete what Ray's retention missed beside the newest checkpoint of ``result`` (a Ray
    ``Result``) under ``checkpoints``; ``keep``: ``train.keep_checkpoints`` (None keeps
    every complete checkpoint). The names removed, sorted."""
    if result.checkpoint is None:
        return []
    newest = PurePosixPath(result.checkpoint.path)
    try:
        folder = checkpoints.at(str(newest.parent))
    except ValueError:  # Ray's storage is not the run's checkpoints folder: not raytrain's
        return []
    kept = result.best_checkpoints or []
    recorded = {PurePosixPath(c.path).name for c, _ in kept} | {newest.name}
    full = keep is not None and len(recorded - {newest.name}) >= keep
    newest_progress = name_progress(newest.name)
    removed = []
    for entry in folder.list_dir():
        progress = name_progress(entry.name)
        dropped = (
            full
            and progress is not None
            and newest_progress is not None
            and entry.name not in recorded
            and progress < newest_progress
            and _ranked_last(entry, monitor, mode)
        )
        if entry.name.endswith(".partial") or dropped:
            entry.delete()
            removed.append(entry.name)
    if removed:
        logger.info("removed checkpoints Ray did not record: %s", ", ".join(sorted(removed)))
    return sorted(removed)


def _ranked_last(directory: StorageLocation, monitor: str, mode: str) -> bool:
    """Whether Ray's ranking puts this checkpoint below every epoch's (its meta.json)."""
    try:
        metrics = json.loads(directory.child(META_FILE).read_text()).get("metrics", {})
    except (OSError, ValueError, AttributeError):
        return False  # unreadable: left as it is
    return checkpoint_score(metrics, monitor, mode) == WORST_SCORE
