"""A node-local working folder for files that are written in place (appended CSV rows,
TensorBoard event files, MLflow's file store) but belong in the run's storage."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from raytrain_app.storage.location import StorageLocation

logger = logging.getLogger(__name__)


class StagingDirectory:
    """Where a process writes the files of ``location``.

    For a local location the staging folder *is* the location: nothing is copied. For any
    other location it is a new folder under the node's temp dir, first filled with
    ``entries`` from storage (a resumed run may land on another node), and :meth:`sync`
    uploads what changed since the last sync.

    Args:
        location: where the files belong.
        entries: the names directly under ``location`` this process owns (files or
            folders); None for everything there.
    """

    def __init__(self, location: StorageLocation, entries: Sequence[str] | None = None) -> None:
        self.location = location
        self._uploaded: dict[Path, tuple[int, int]] = {}
        if location.is_local:
            self.local = location.local_path
            self.local.mkdir(parents=True, exist_ok=True)
            self._scratch = False
            return
        self.local = Path(tempfile.mkdtemp(prefix="raytrain-staging-"))
        self._scratch = True
        for item in location.list_dir():
            if entries is None or item.name in entries:
                item.download(self.local if item.is_file() else self.local / item.name)
        self._uploaded = self._changed()

    def _changed(self) -> dict[Path, tuple[int, int]]:
        """Local files whose size or modification time differs from the last upload."""
        changed = {}
        for file in self.local.rglob("*"):
            if file.is_file():
                stat = file.stat()
                key = (stat.st_size, stat.st_mtime_ns)
                if self._uploaded.get(file) != key:
                    changed[file] = key
        return changed

    def sync(self) -> None:
        """Upload the files that changed since the last sync (nothing for a local location)."""
        if not self._scratch:
            return
        for file, key in self._changed().items():
            self.location.child(*file.relative_to(self.local).parts).upload(file)
            self._uploaded[file] = key

    def close(self) -> None:
        """Sync a last time and remove the local copy."""
        if not self._scratch:
            return
        try:
            self.sync()
        finally:
            shutil.rmtree(self.local, ignore_errors=True)
            self._scratch = False
