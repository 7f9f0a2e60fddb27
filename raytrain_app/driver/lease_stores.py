"""Where a run directory's lease lives and how it is written atomically: an exclusive
create on a filesystem (local or shared), a conditional put on S3 (``If-None-Match`` to
create, ``If-Match`` on the last ETag to refresh, take over or delete)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from raytrain_app.errors import BadInputError

logger = logging.getLogger(__name__)

# The lease's name in the run directory; its helper files (.tmp, .takeover) start with it too.
LEASE_FILE = ".lease.json"

_ABANDONED_TAKEOVER_S = 3.0  # a takeover holds its lock for a read and a write

_S3_CONFLICTS = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}

_S3_MISSING = {"NoSuchKey", "404"}


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds a run directory: what the lease file holds."""

    token: str  # unique per holder; a heartbeat or release touches only its own
    command: str  # "train" or "tune"
    host: str
    pid: int
    started_at: float  # seconds since the epoch
    heartbeat_at: float
    slurm_job_id: str | None = None

    def to_bytes(self) -> bytes:
        fields: dict[str, Any] = asdict(self)
        for key in ("started_at", "heartbeat_at"):
            fields[key] = datetime.fromtimestamp(fields[key], timezone.utc).isoformat()
        return json.dumps(fields, indent=2).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> LeaseRecord | None:
        """The record, or None when ``raw`` is not one (empty while being created, or damaged)."""
        try:
            fields = json.loads(raw)
            for key in ("started_at", "heartbeat_at"):
                fields[key] = datetime.fromisoformat(fields[key]).timestamp()
            return cls(**fields)
        except (ValueError, TypeError, KeyError):
            return None

    def owner(self) -> str:
        """``raytrain train on host h (pid 123, since 12:00:03)``."""
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return (
            f"raytrain {self.command} on host {self.host} "
            f"(pid {self.pid}{job}, since {_clock(self.started_at)})"
        )


@dataclass(frozen=True)
class StoredLease:
    """A lease as read back, with what a conditional replace needs."""

    raw: bytes
    version: str  # the ETag on S3; unused on a filesystem, which compares ``raw``
    modified_at: float

    @property
    def record(self) -> LeaseRecord | None:
        return LeaseRecord.from_bytes(self.raw)


class LeaseStore(Protocol):
    """Where a lease lives, and the atomic operations on it."""

    location: str
    errors: tuple[type[BaseException], ...]  # what its operations raise on I/O failures

    def prepare(self) -> None: ...

    def create(self, raw: bytes) -> bool:
        """Write ``raw`` if no lease exists; False if one does."""
        ...

    def read(self) -> StoredLease | None: ...

    def replace(self, stale: StoredLease, raw: bytes) -> bool:
        """Put ``raw`` in place of ``stale``; False if it changed or went meanwhile."""
        ...

    def overwrite(self, current: StoredLease, raw: bytes) -> bool:
        """Refresh our own lease, ``current``, with ``raw`` (never absent in between)."""
        ...

    def delete(self, current: StoredLease) -> None: ...

    def cleanup(self) -> None: ...


class FileLeaseStore:
    """A lease on a local or shared filesystem (NFS, Lustre, GPFS: ``O_EXCL`` is atomic).

    The lease file is never absent while held: heartbeats and takeovers write a new file and
    ``os.replace`` it in. A takeover first takes a short-lived lock (``.lease.json.takeover``,
    exclusive create), so that of two takers who both judged the lease stale only the first
    replaces it; the second finds a fresh lease under the lock and looks again.
    """

    errors = (OSError,)

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LEASE_FILE
        self.location = str(self.path)
        self._takeover_lock = directory / f"{LEASE_FILE}.takeover"
        self._busy_lock: tuple[tuple[int, int], float] | None = None  # (identity, first seen)
        self._made_directory = False

    def prepare(self) -> None:
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            self.directory.mkdir()
            self._made_directory = True

    def create(self, raw: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as file:
            file.write(raw)
        return True

    def read(self) -> StoredLease | None:
        try:
            with open(self.path, "rb") as file:
                return StoredLease(file.read(), "", os.fstat(file.fileno()).st_mtime)
        except FileNotFoundError:
            return None

    def replace(self, stale: StoredLease, raw: bytes) -> bool:
        if not self._lock_takeover():
            return False
        try:
            current = self.read()
            if current is None or current.raw != stale.raw:
                return False  # its owner's heartbeat, or a faster taker, came first
            self._write_in_place(raw)
            return True
        finally:
            self._takeover_lock.unlink(missing_ok=True)

    def overwrite(self, current: StoredLease, raw: bytes) -> bool:
        self._write_in_place(raw)
        return True

    def delete(self, current: StoredLease) -> None:
        self.path.unlink(missing_ok=True)

    def cleanup(self) -> None:
        """Remove the run directory again if the lease made it and nothing else was written."""
        if self._made_directory:
            with contextlib.suppress(OSError):
                self.directory.rmdir()

    def _write_in_place(self, raw: bytes) -> None:
        tmp = self.path.with_name(f"{LEASE_FILE}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(raw)
        os.replace(tmp, self.path)

    def _lock_takeover(self) -> bool:
        try:
            os.close(os.open(self._takeover_lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return True
        except FileExistsError:
            self._remove_abandoned_lock()
            return False

    def _remove_abandoned_lock(self) -> None:
        """Remove a takeover lock left by a taker that died holding it (held for milliseconds
        otherwise). Timed by this process's clock: a shared filesystem's mtimes may be skewed."""
        try:
            stat = os.stat(self._takeover_lock)
        except FileNotFoundError:
            return
        identity, now = (stat.st_ino, stat.st_mtime_ns), time.monotonic()
        if self._busy_lock is None or self._busy_lock[0] != identity:
            self._busy_lock = (identity, now)
        elif now - self._busy_lock[1] > _ABANDONED_TAKEOVER_S:
            logger.warning("removing the abandoned takeover lock %s", self._takeover_lock)
            self._takeover_lock.unlink(missing_ok=True)
            self._busy_lock = None


class S3LeaseStore:
    """A lease object on S3 (or an S3-compatible store) behind conditional puts.

    The endpoint and credentials are boto3's own: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
    profiles, instance roles.
    """

    def __init__(self, bucket: str, key: str) -> None:
        try:
            import boto3
            import botocore.exceptions
        except ImportError:
            raise BadInputError(
                f"the lease of run directory 's3://{bucket}/{key}' needs boto3, which is not "
                f"installed; pip install boto3 (or pip install 'raytrain_app[s3]')"
            ) from None
        self.bucket, self.key = bucket, key
        self.location = f"s3://{bucket}/{key}"
        self.errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
        self._client_error = botocore.exceptions.ClientError
        # A fresh session: the default one keeps the credentials it found first.
        self._s3 = boto3.session.Session().client("s3")

    def prepare(self) -> None:
        pass  # an object store has no directories to make

    def _code(self, exc: BaseException) -> str | None:
        if isinstance(exc, self._client_error):
            return str(exc.response.get("Error", {}).get("Code"))
        return None

    def _put(self, raw: bytes, **condition: str) -> bool:
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self.key, Body=raw, **condition)
        except self._client_error as exc:
            if self._code(exc) in _S3_CONFLICTS | _S3_MISSING:
                return False
            raise
        return True

    def create(self, raw: bytes) -> bool:
        return self._put(raw, IfNoneMatch="*")

    def read(self) -> StoredLease | None:
        try:
            found = self._s3.get_object(Bucket=self.bucket, Key=self.key)
        except self._client_error as exc:
            if self._code(exc) in _S3_MISSING:
                return None
            raise
        return StoredLease(found["Body"].read(), found["ETag"], found["LastModified"].timestamp())

    def replace(self, stale: StoredLease, raw: bytes) -> bool:
        return self._put(raw, IfMatch=stale.version)

    def overwrite(self, current: StoredLease, raw: bytes) -> bool:
        return self._put(raw, IfMatch=current.version)

    def delete(self, current: StoredLease) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=current.version)
        except self._client_error as exc:
            if self._code(exc) in _S3_CONFLICTS | _S3_MISSING:
                return  # no longer ours (or gone): not ours to delete
            if self._code(exc) != "NotImplemented":
                raise
            # A store without conditional deletes: ours a moment ago, when it was read.
            self._s3.delete_object(Bucket=self.bucket, Key=self.key)

    def cleanup(self) -> None:
        pass


def lease_store(root: str, warn: bool = True) -> LeaseStore | None:
    """The lease store for the run directory ``root`` (a local path or a URI); None (after a
    warning, unless ``warn`` is false) where no atomic create is available."""
    scheme, sep, rest = root.partition("://")
    if not sep:
        return FileLeaseStore(Path(root))
    if scheme == "file":
        return FileLeaseStore(Path(rest))
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise BadInputError(
                f"run directory '{root}' names no bucket; set experiment.output_dir to "
                f"s3://BUCKET/PREFIX"
            )
        prefix = prefix.strip("/")
        return S3LeaseStore(bucket, f"{prefix}/{LEASE_FILE}" if prefix else LEASE_FILE)
    if warn:
        logger.warning(
            "no lease guards run directory '%s' (%s:// has no atomic create here): make sure "
            "only one run writes there at a time",
            root,
            scheme,
        )
    return None


def _clock(timestamp: float) -> str:
    """A local wall-clock time, with the date unless it is today."""
    moment = datetime.fromtimestamp(timestamp)
    today = moment.date() == datetime.now().date()
    return moment.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S")
