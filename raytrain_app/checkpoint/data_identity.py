"""The data a checkpoint was trained on: recorded in its ``meta.json``, checked on resume.

A resume applies the checkpoint's (epoch, step) to the data it finds. Parquet files added,
removed or rewritten under ``data.path`` give other windows, other steps per epoch and
other statistics (streaming data: another prepared store), so the resumed run would train
on other data in another order without a word. So every checkpoint of a ``data.path`` run
records the files (name under ``data.path``, size and mtime: what the prepared store's key
hashes) and, for streaming data, the store's key and its manifest's SHA-256. The driver
lists the data before it prepares it and refuses a resume on other data in one line
naming the files; a checkpoint written before this record existed resumes as before.
"""

from __future__ import annotations

import glob
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raytrain_app.checkpoint.ranking import metas_newest_first
from raytrain_app.config import DataConfig
from raytrain_app.data.parquet_source import DataFile, resolve_paths
from raytrain_app.data.stream_choice import streams
from raytrain_app.data.stream_manifest import MANIFEST_NAME
from raytrain_app.data.stream_prepare import locate_store
from raytrain_app.data.stream_store import file_info
from raytrain_app.errors import BadInputError
from raytrain_app.storage import StorageLocation, is_uri
from raytrain_app.workloads import FactoryRef, _data_path, stream_cache_root

logger = logging.getLogger(__name__)

IDENTITY_KEY = "data_identity"  # meta.json's key
_SHOWN = 3  # file names a refusal lists per kind of change
_DIGEST = r"^[0-9a-f]{64}$"
_NEW_RUN = "start a new run with a new experiment.name"


class FileRecord(BaseModel):
    """One Parquet file of ``data.path``: its name under it, size and mtime in ns."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    size: int | None
    mtime_ns: int | None


class DataIdentity(BaseModel):
    """What ``meta.json`` records of the data; parsed strictly (a run directory is data)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    files: list[FileRecord] = Field(min_length=1)
    store_key: str | None = Field(default=None, pattern=_DIGEST)  # streaming data only
    manifest_sha256: str | None = Field(default=None, pattern=_DIGEST)  # likewise


@dataclass
class ResumedData:
    """The run's data as listed now, and what its newest checkpoint recorded.

    Attributes:
        identity: the data now (None: the data is not read from ``data.path``).
        path: ``data.path`` as configured, for messages.
        checkpoint: the checkpoint whose record ``recorded`` is.
        recorded: what it recorded (None: no checkpoint, or one without a record).
        manifest: streaming data's prepared manifest, once ``prepared`` read it.
    """

    identity: DataIdentity | None
    path: str = ""
    checkpoint: str = ""
    recorded: DataIdentity | None = None
    manifest: StorageLocation | None = None

    @classmethod
    def checked(
        cls,
        data: DataConfig,
        checkpoints: StorageLocation,
        data_dir: StorageLocation,
        resuming: bool,
    ) -> ResumedData:
        """List ``data.path`` (before the prepare pass) and, when ``resuming``, compare it
        with the newest checkpoint under ``checkpoints``.

        Raises:
            BadInputError: the files differ from those the checkpoint was trained on.
        """
        if not data.path:  # built-in data is made from the config, which a resume keeps
            return cls(None)
        found = cls(_listed(data, data_dir), data.path)
        if resuming:
            found.checkpoint, found.recorded = _recorded(checkpoints)
            found._compare()
        return found

    def prepared(self, data: FactoryRef) -> dict[str, Any] | None:
        """What each checkpoint's ``meta.json`` records, once the data is prepared (``data``:
        what workers load): with streaming data the digest of the manifest they read,
        compared with the checkpoint's too.

        Raises:
            BadInputError: the prepared store differs from the checkpoint's.
        """
        if self.identity is None:
            return None
        folder = data.params.get("folder") if self.identity.store_key else None
        if folder is not None:
            self.manifest = StorageLocation.parse(folder, "data.cache_dir").child(MANIFEST_NAME)
            digest = hashlib.sha256(self.manifest.read_bytes()).hexdigest()
            self.identity = self.identity.model_copy(update={"manifest_sha256": digest})
            self._compare()
        return self.identity.model_dump()

    def _compare(self) -> None:
        old, new = self.recorded, self.identity
        if old is None or new is None:
            return
        changes = file_changes(old.files, new.files)
        if changes:
            raise BadInputError(
                f"data.path '{self.path}' no longer holds the data that checkpoint "
                f"'{self.checkpoint}' was trained on (files {changes}), and a resume would "
                f"train on other windows in another order; restore those files as they were, "
                f"or {_NEW_RUN}"
            )
        for what, before, now, why in (
            ("key", old.store_key, new.store_key, "this raytrain version prepares it otherwise"),
            (
                f"manifest ({self.manifest})",
                old.manifest_sha256,
                new.manifest_sha256,
                "it was prepared again, differently",
            ),
        ):
            if before and now and before != now:
                raise BadInputError(
                    f"data.path '{self.path}' holds the same files as when checkpoint "
                    f"'{self.checkpoint}' was written, but their prepared store's {what} "
                    f"differs ({why}), and a resume would train on other windows in another "
                    f"order; {_NEW_RUN}"
                )


def file_changes(old: list[FileRecord], new: list[FileRecord]) -> str:
    """``added: a, b; removed: c; changed: d and 2 more``; empty for the same files."""
    before = {f.name: (f.size, f.mtime_ns) for f in old}
    now = {f.name: (f.size, f.mtime_ns) for f in new}
    kinds = {
        "added": sorted(now.keys() - before.keys()),
        "removed": sorted(before.keys() - now.keys()),
        "changed": sorted(n for n in before.keys() & now.keys() if before[n] != now[n]),
    }
    return "; ".join(f"{kind}: {_few(names)}" for kind, names in kinds.items() if names)


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _listed(data: DataConfig, data_dir: StorageLocation) -> DataIdentity:
    """The files of ``data.path`` now and, streaming, their store's key: the listing the
    prepare pass makes, no data read."""
    path = _data_path(data.path, absolute=True)
    key = None
    if streams(data.streaming, path):  # the resolved config says true or false: no listing
        spot = locate_store(path, data.params, stream_cache_root(data, data_dir))
        files, infos, key = spot.files, spot.infos, spot.key
    else:
        files = resolve_paths(path)
        infos = [file_info(f) for f in files]
    fixed = _fixed_part(path)
    records = [
        FileRecord(name=_name(_path_of(f), fixed), size=size, mtime_ns=mtime)
        for f, (_, size, mtime) in zip(files, infos, strict=True)
    ]
    return DataIdentity(files=records, store_key=key)


def _fixed_part(path: str) -> str:
    """``data.path`` up to its first glob pattern, as a filesystem path (``bucket/key``)."""
    if is_uri(path):
        parts = urlsplit(path)
        path = parts.netloc + parts.path
    kept = []
    for part in path.split("/"):
        if glob.has_magic(part):
            break
        kept.append(part)
    return "/".join(kept).rstrip("/")


def _path_of(file: DataFile) -> str:
    return file.path if isinstance(file, StorageLocation) else str(Path(file).absolute())


def _name(path: str, fixed: str) -> str:
    """A file's name under ``data.path``: what messages show (``data.path`` itself, which
    a resume keeps, leaves no doubt about the rest)."""
    if path.startswith(fixed + "/"):
        return path[len(fixed) + 1 :]
    return path.rsplit("/", 1)[-1] if path == fixed else path


def _recorded(checkpoints: StorageLocation) -> tuple[str, DataIdentity | None]:
    """The newest readable checkpoint under ``checkpoints`` and what it recorded."""
    for where, meta in metas_newest_first(checkpoints):
        if meta is None:
            continue
        if IDENTITY_KEY not in meta:
            logger.warning(
                "checkpoint %s records no data identity (an older raytrain wrote it): "
                "resuming without checking that data.path still holds the same files",
                where,
            )
            return str(where), None
        try:
            return str(where), DataIdentity.model_validate(meta[IDENTITY_KEY])
        except ValidationError as exc:
            error = exc.errors()[0]
            at = ".".join(str(part) for part in (IDENTITY_KEY, *error["loc"]))
            raise BadInputError(
                f"'{where}/meta.json' is not a raytrain checkpoint's metadata ({at}: "
                f"{error['msg'].lower()}); it was edited or damaged: delete that checkpoint "
                f"to resume from an older one, or {_NEW_RUN}"
            ) from None
    return "", None
