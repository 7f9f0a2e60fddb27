"""One writer per run directory: a lease, ``<run dir>/.lease.json``, held while a run writes.

Two runs writing one run directory interleave their metrics rows and prune each other's
checkpoints. The first ``raytrain train`` or ``tune`` takes the lease, created atomically (an
exclusive create on a filesystem, a conditional put on S3), and refreshes its heartbeat while
it runs; a second is refused with one line that names the owner. A lease whose owner is gone
(no heartbeat for ``STALE_AFTER_S``, its process dead on this host, or this very SLURM job,
requeued) is taken over, so a killed or requeued run still resumes. Other URI schemes run
unguarded, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from raytrain_app.driver.lease_stores import (
    LeaseRecord,
    LeaseStore,
    StoredLease,
    lease_store,
)
from raytrain_app.errors import BadInputError, first_line
from raytrain_app.planning.environment import detect_environment

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
# Six missed heartbeats: long enough for a slow shared filesystem or a busy driver, short
# enough that a re-run after a crash on another host waits only a minute.
STALE_AFTER_S = 60.0
# An exclusive create leaves the file empty for an instant before its content is written.
_UNREADABLE_GRACE_S = 2.0
_CLAIM_TIMEOUT_S = 10.0  # against a directory whose lease keeps changing under us
_RETRY_S = 0.05


class RunLease:
    """The lease on one run directory: claimed once, refreshed by a daemon thread, released."""

    def __init__(
        self,
        store: LeaseStore,
        root: str,
        record: LeaseRecord,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.store = store
        self.root = root
        self.record = record
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.lost = threading.Event()  # set if another run took the lease from us
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a release waits for a heartbeat in flight
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Claim the lease and start the heartbeat.

        Raises:
            BadInputError: a live run holds it, or its storage cannot be written.
        """
        try:
            self.store.prepare()
            self._claim()
        except BaseException as exc:
            self.store.cleanup()
            if not isinstance(exc, self.store.errors):
                raise
            raise BadInputError(
                f"cannot write the lease of run directory '{self.root}' at "
                f"{self.store.location} ({first_line(exc)}); check experiment.output_dir and "
                f"that it is writable"
            ) from None
        self._thread = threading.Thread(
            target=self._beat_until_released, name=f"run-lease {self.root}", daemon=True
        )
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours; never raises."""
        self._stop.set()
        with self._lock:
            try:
                current = self.store.read()
                if self._is_ours(current):
                    self.store.delete(current)
            except self.store.errors as exc:
                logger.warning(
                    "could not remove the lease of run directory '%s' (%s); the next run "
                    "takes it over once it is stale",
                    self.root,
                    first_line(exc),
                )
            self.store.cleanup()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s)

    def _claim(self) -> None:
        deadline = time.monotonic() + _CLAIM_TIMEOUT_S
        while time.monotonic() < deadline:
            now = time.time()
            self.record = replace(self.record, started_at=now, heartbeat_at=now)
            if self.store.create(self.record.to_bytes()):
                return
            found = self.store.read()
            if found is None:
                continue  # released meanwhile
            owner = found.record
            reason = self._gone_reason(found, now)
            if reason is None:
                if owner is not None:
                    raise self._held_by(owner)
                time.sleep(_RETRY_S)  # being created: its content follows in a moment
            elif self.store.replace(found, self.record.to_bytes()):
                held_by = owner.owner() if owner else "an unknown owner"
                logger.warning(
                    "taking over run directory '%s' from %s: %s", self.root, held_by, reason
                )
                return
            else:
                time.sleep(_RETRY_S)  # another taker is at work: look again in a moment
        raise BadInputError(
            f"run directory '{self.root}' has a lease ({self.store.location}) that keeps "
            f"changing or cannot be read; if no run writes there, delete it and retry"
        )

    def check_free(self) -> None:
        """Raise as ``acquire`` would when a live run holds the lease, writing nothing:
        a second run is refused before it starts Ray (``acquire`` still claims it later)."""
        try:
            found = self.store.read()
        except self.store.errors:
            return  # acquire says what is wrong with the storage
        owner = found.record if found is not None else None
        if owner is not None and self._gone_reason(found, time.time()) is None:
            raise self._held_by(owner)

    def _held_by(self, owner: LeaseRecord) -> BadInputError:
        return BadInputError(
            f"run directory '{self.root}' is being written by {owner.owner()}; "
            f"wait for it to finish, stop it, or choose another experiment.name"
        )

    def _gone_reason(self, found: StoredLease, now: float) -> str | None:
        """Why the lease's owner counts as gone, or None while it may still be writing."""
        owner = found.record
        if owner is None:
            silent = now - found.modified_at
            if silent > max(_UNREADABLE_GRACE_S, self.stale_after_s):
                return f"its lease is unreadable and unchanged for {silent:.0f} s"
            return None
        silent = now - owner.heartbeat_at
        if silent > self.stale_after_s:
            return f"no heartbeat for {silent:.0f} s"
        if owner.host == self.record.host:
            # A SLURM job running two raytrain commands on this node is not a requeue.
            return None if _pid_alive(owner.pid) else f"its process {owner.pid} has exited"
        job = self.record.slurm_job_id
        if job and owner.slurm_job_id == job:
            return f"it is this SLURM job ({job}), requeued"
        return None

    def _is_ours(self, found: StoredLease | None) -> bool:
        record = found.record if found else None
        return record is not None and record.token == self.record.token

    def _beat_until_released(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    ours = self._beat()
                except self.store.errors as exc:
                    logger.warning(
                        "could not refresh the lease of run directory '%s' (%s); retrying",
                        self.root,
                        first_line(exc),
                    )
                    continue
                if not ours:
                    self.lost.set()
                    logger.error(
                        "lost the lease of run directory '%s' to another run; both may now "
                        "write there",
                        self.root,
                    )
                    return

    def _beat(self) -> bool:
        """Refresh the heartbeat if the lease is still ours; False if another run holds it."""
        self.record = replace(self.record, heartbeat_at=time.time())
        current = self.store.read()
        if current is None:
            # Deleted by hand, or moved aside for a moment by a taker who will put it back.
            return self.store.create(self.record.to_bytes())
        return self._is_ours(current) and self.store.overwrite(current, self.record.to_bytes())


@contextlib.contextmanager
def hold_run_lease(
    root: str,
    command: str,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    stale_after_s: float = STALE_AFTER_S,
) -> Iterator[RunLease | None]:
    """Hold the lease on the run directory ``root`` while the body runs.

    Args:
        root: the run directory, resolved: an absolute local path or a URI.
        command: what writes there, ``train`` or ``tune`` (shown to a refused second run).

    Yields:
        The lease, or None where ``root``'s scheme has no lease (a warning says so).

    Raises:
        BadInputError: another live run holds the directory (exit code 2).
    """
    store = lease_store(root)
    if store is None:
        yield None
        return
    lease = RunLease(
        store, root, _this_holder(command), heartbeat_s=heartbeat_s, stale_after_s=stale_after_s
    )
    with _sigterm_raises_system_exit():
        lease.acquire()
        try:
            yield lease
        finally:
            lease.release()


def refuse_if_held(root: str, command: str) -> None:
    """Refuse at once (exit code 2) when a live run holds ``root``, writing nothing (where
    no lease can be kept, ``hold_run_lease`` warns later)."""
    store = lease_store(root, warn=False)
    if store is not None:
        RunLease(store, root, _this_holder(command)).check_free()


def _this_holder(command: str) -> LeaseRecord:
    slurm = detect_environment().slurm
    now = time.time()
    return LeaseRecord(
        token=uuid.uuid4().hex,
        command=command,
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=now,
        heartbeat_at=now,
        slurm_job_id=slurm.job_id if slurm else None,
    )


@contextlib.contextmanager
def _sigterm_raises_system_exit() -> Iterator[None]:
    """Where SIGTERM would kill the process outright, make it exit through ``finally`` blocks
    instead, so that the lease is released (the run's own stop handlers take precedence)."""
    in_main = threading.current_thread() is threading.main_thread()
    if not in_main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def exit_on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is exit_on_sigterm:  # not replaced by someone else
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
