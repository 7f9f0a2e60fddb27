"""Where a run directory's lease lives and how it is written atomically: an exclusive
create on a filesystem (local or shared), a conditional put on S3 (``If-None-Match`` to
create, ``If-Match`` on the last ETag to refresh, take over or delete).

Every change after the create is a compare-and-swap (``replace``): a heartbeat, a takeover
and a release all write only if the lease is still exactly what they read, so a writer that
stalls between its read and its write cannot undo what another wrote meanwhile."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from raytrain_app.errors import BadInputError

logger = logging.getLogger(__name__)

# The lease's name in the run directory; its helper files (.tmp, .lock) start with it too.
LEASE_FILE = ".lease.json"

# The swap lock is held for a read and a write (milliseconds); one unchanged this long was
# left by a process that died holding it.
_ABANDONED_LOCK_S = 3.0

_S3_CONFLICTS = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}

_S3_MISSING = {"NoSuchKey", "404"}


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds a run directory: what the lease file holds."""

    token: str  # unique per holder; a heartbeat or release touches only its own
    command: str  # "train" or "tune"
    host: str
    pid: int
    started_at: float  # seconds since the epoch, shown to a refused run
    # The holder's wall clock at its last heartbeat: for people reading the file only.
    # Staleness is never judged from it (another host's clock may be minutes off): a
    # reader times how long the lease stays unchanged, on its own clock (run_lease).
    heartbeat_at: float
    slurm_job_id: str | None = None
    beats: int = 0  # counts the heartbeats, so that each one changes the lease
    heartbeat_s: float = 10.0  # the holder's interval: how long a reader waits for a change

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

    def replace(self, expected: StoredLease, raw: bytes) -> bool:
        """Put ``raw`` in place of ``expected``, atomically, only if the lease is still
        ``expected``; False if it changed or went meanwhile (or, on a filesystem, another
        writer holds the lock for a moment: read again and retry)."""
        ...

    def delete(self, expected: StoredLease) -> None:
        """Delete the lease if it is still ``expected``; otherwise leave it alone."""
        ...

    def cleanup(self) -> None: ...


class FileLeaseStore:
    """A lease on a local or shared filesystem (NFS, Lustre, GPFS: ``O_EXCL`` is atomic).

    The lease file is never absent while held: heartbeats and takeovers write a new file and
    ``os.replace`` it in. A filesystem has no compare-and-swap, so every change after the
    create takes a short-lived lock first (``.lease.json.lock``, exclusive create), then
    compares and writes: of a taker and a heartbeat that both read one version, only the
    first to lock writes, and the second finds the lease changed.
    """

    errors = (OSError,)

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LEASE_FILE
        self.location = str(self.path)
        self._lock_path = directory / f"{LEASE_FILE}.lock"
        self._busy_lock: tuple[tuple[int, bytes], float] | None = None  # (identity, first seen)
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

    def replace(self, expected: StoredLease, raw: bytes) -> bool:
        with self._locked() as nonce:
            if nonce is None or not self._still(expected):
                return False  # the owner's heartbeat, a taker or another writer came first
            tmp = self.path.with_name(f"{LEASE_FILE}.{uuid.uuid4().hex}.tmp")
            tmp.write_bytes(raw)
            # A stall since the lock was taken, long enough for a taker to judge the lock
            # abandoned and take it, must not end in our write over theirs.
            if not self._holds(nonce):
                tmp.unlink(missing_ok=True)
                return False
            os.replace(tmp, self.path)
            return True

    def delete(self, expected: StoredLease) -> None:
        # Retried while another writer holds the lock (or until it is judged abandoned):
        # a lease left behind would make the next run wait for it to go stale.
        deadline = time.monotonic() + _ABANDONED_LOCK_S + 1.0
        while True:
            with self._locked() as nonce:
                if nonce is not None:
                    if self._still(expected) and self._holds(nonce):
                        self.path.unlink(missing_ok=True)
                    return
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def cleanup(self) -> None:
        """Remove the run directory again if the lease made it and nothing else was written."""
        if self._made_directory:
            with contextlib.suppress(OSError):
                self.directory.rmdir()

    def _still(self, expected: StoredLease) -> bool:
        current = self.read()
        return current is not None and current.raw == expected.raw

    @contextlib.contextmanager
    def _locked(self) -> Iterator[bytes | None]:
        """Hold the lock for the body: yields its nonce, or None when another holds it."""
        nonce = uuid.uuid4().hex.encode()
        try:
            fd = os.open(self._lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self._remove_abandoned_lock()
            yield None
            return
        with os.fdopen(fd, "wb") as file:
            file.write(nonce)
        try:
            yield nonce
        finally:
            if self._holds(nonce):  # a taker may have judged it abandoned: then it is theirs
                self._lock_path.unlink(missing_ok=True)

    def _holds(self, nonce: bytes) -> bool:
        try:
            return self._lock_path.read_bytes() == nonce
        except FileNotFoundError:
            return False

    def _remove_abandoned_lock(self) -> None:
        """Remove a lock left by a writer that died holding it (held for milliseconds
        otherwise). Timed by this process's clock on the lock's unchanged identity (its
        nonce: inode numbers are reused), never by its mtime: a shared filesystem's clock
        may be skewed."""
        identity = self._lock_identity()
        if identity is None:
            return
        now = time.monotonic()
        if self._busy_lock is None or self._busy_lock[0] != identity:
            self._busy_lock = (identity, now)
        elif now - self._busy_lock[1] > _ABANDONED_LOCK_S:
            # Another taker may have removed it and locked anew since we looked.
            if self._lock_identity() == identity:
                logger.warning("removing the abandoned lease lock %s", self._lock_path)
                self._lock_path.unlink(missing_ok=True)
            self._busy_lock = None

    def _lock_identity(self) -> tuple[int, bytes] | None:
        try:
            with open(self._lock_path, "rb") as file:
                return os.fstat(file.fileno()).st_ino, file.read()
        except FileNotFoundError:
            return None


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

    def replace(self, expected: StoredLease, raw: bytes) -> bool:
        return self._put(raw, IfMatch=expected.version)

    def delete(self, expected: StoredLease) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=expected.version)
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
