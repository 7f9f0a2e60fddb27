"""One writer per run directory: a lease, ``<run dir>/.lease.json``, held while a run writes.

Two runs writing one run directory interleave their metrics rows and prune each other's
checkpoints. The first ``raytrain train`` or ``tune`` takes the lease, created atomically (an
exclusive create on a filesystem, a conditional put on S3), and beats its heartbeat while
it runs: each beat changes the lease, by a compare-and-swap that fails if another run took
it meanwhile. A second run is refused with one line that names the owner.

Whether the owner is gone is judged on the reader's own clock, never by comparing the
lease's timestamps with it (another host's clock may be minutes off): a lease that stays
unchanged for ``STALE_AFTER_S`` while a would-be taker watches it, whose process is dead on
this host, or that this very SLURM job holds (requeued) is taken over, so a killed or
requeued run still resumes. A run that finds its lease taken, or cannot beat for half that
time, stops writing at once (its workers through the run control) and fails in one line.
Other URI schemes run unguarded, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

from raytrain_app.driver.lease_stores import LeaseRecord, LeaseStore, StoredLease, lease_store
from raytrain_app.driver.signals import sigterm_exits_through_finally
from raytrain_app.errors import BadInputError, RunFailedError, first_line
from raytrain_app.planning.environment import detect_slurm
from raytrain_app.worker.stop_request import lease_lost

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
# Six missed heartbeats: long enough for a slow shared filesystem or a busy driver, short
# enough that a re-run after a crash on another host waits only a minute.
STALE_AFTER_S = 60.0
# An exclusive create leaves the file empty for an instant before its content is written.
_UNREADABLE_GRACE_S = 2.0
_CLAIM_TIMEOUT_S = 10.0  # beyond the stale wait, against a lease that keeps changing
_RETRY_S = 0.05
_WATCH_POLL_S = 1.0  # at most; a tenth of the holder's heartbeat interval where shorter


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
        self.record = replace(record, heartbeat_s=heartbeat_s)
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.lost = threading.Event()  # set once this run may no longer write
        self.lost_reason: str | None = None  # the one-line error, once lost
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

    def check(self) -> None:
        """Raise the one-line error if this run lost the lease (call before each write)."""
        if self.lost_reason is not None:
            raise RunFailedError(self.lost_reason)

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
        watch = _Watch()
        deadline = time.monotonic() + self.stale_after_s + _CLAIM_TIMEOUT_S
        while time.monotonic() < deadline:
            now = time.time()
            self.record = replace(self.record, started_at=now, heartbeat_at=now)
            if self.store.create(self.record.to_bytes()):
                return
            found = self.store.read()
            if found is None:
                continue  # released meanwhile
            reason = self._gone_reason(found, watch)  # raises if its owner is alive
            if reason is None:
                watch.announce(self.root, found, self.stale_after_s)
                time.sleep(self._poll_s(found))
            elif self.store.replace(found, self.record.to_bytes()):
                owner = found.record
                held_by = owner.owner() if owner else "an unknown owner"
                logger.warning(
                    "taking over run directory '%s' from %s: %s", self.root, held_by, reason
                )
                return
            else:
                time.sleep(_RETRY_S)  # another writer is at work: look again in a moment
        raise BadInputError(
            f"run directory '{self.root}' has a lease ({self.store.location}) that keeps "
            f"changing or cannot be read; if no run writes there, delete it and retry"
        )

    def check_free(self) -> None:
        """Raise as ``acquire`` would when a live run holds the lease, writing nothing:
        a second run is refused before it starts Ray (``acquire`` still claims it later).

        Watches the lease for up to two of its owner's heartbeats; a lease that did not
        change meanwhile is left for ``acquire`` to judge.
        """
        watch = _Watch()
        try:
            found = self.store.read()
            owner = found.record if found is not None else None
            if owner is None:
                return  # absent, or being created: acquire judges it
            deadline = time.monotonic() + min(self.stale_after_s, 2 * owner.heartbeat_s)
            while found is not None and self._gone_reason(found, watch) is None:
                if time.monotonic() >= deadline:
                    return
                time.sleep(self._poll_s(found))
                found = self.store.read()
        except self.store.errors:
            return  # acquire says what is wrong with the storage

    def _held_by(self, owner: LeaseRecord) -> BadInputError:
        return BadInputError(
            f"run directory '{self.root}' is being written by {owner.owner()}; "
            f"wait for it to finish, stop it, or choose another experiment.name"
        )

    def _gone_reason(self, found: StoredLease, watch: _Watch) -> str | None:
        """Why the lease's owner counts as gone, or None while that is not known yet.

        Raises:
            BadInputError: its owner is alive (its heartbeat changed the lease meanwhile).
        """
        owner = found.record
        silent = watch.unchanged_for(found.raw)
        if owner is None:
            if silent > max(_UNREADABLE_GRACE_S, self.stale_after_s):
                return f"its lease is unreadable and unchanged for {silent:.0f} s"
            return None
        job = self.record.slurm_job_id
        if owner.host == self.record.host:
            # (A SLURM job running two raytrain commands on this node is not a requeue.)
            if not _pid_alive(owner.pid):
                return f"its process {owner.pid} has exited"
            # One host, one clock: a heartbeat this recent means its live process owns it.
            # Only to refuse at once; a takeover always needs the lease seen unchanged.
            if time.time() - owner.heartbeat_at < self.stale_after_s:
                raise self._held_by(owner)
        elif job and owner.slurm_job_id == job:
            return f"it is this SLURM job ({job}), requeued"
        if watch.changed:
            raise self._held_by(owner)
        if silent > self.stale_after_s:
            return f"its lease has not changed for {silent:.0f} s (no heartbeat)"
        return None

    def _poll_s(self, found: StoredLease) -> float:
        owner = found.record
        return min(_WATCH_POLL_S, max(0.01, owner.heartbeat_s / 10)) if owner else _RETRY_S

    def _is_ours(self, found: StoredLease | None) -> bool:
        record = found.record if found else None
        return record is not None and record.token == self.record.token

    def _beat_until_released(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    beat = self._beat()
                except self.store.errors as exc:
                    if self._gave_up(time.monotonic() - last_beat, exc):
                        return
                    continue
                if beat is True:
                    last_beat = time.monotonic()
                elif beat is False:
                    return

    def _gave_up(self, silent: float, exc: BaseException) -> bool:
        """After a failed beat: True, and the lease lost, once we have not beaten for half
        the stale interval. A taker waits the whole interval from its first look at our last
        beat, so we stop writing well before it could start."""
        if silent <= self.stale_after_s / 2:
            logger.warning(
                "could not refresh the lease of run directory '%s' (%s); retrying",
                self.root,
                first_line(exc),
            )
            return False
        self._lose(
            f"could not refresh the lease of run directory '{self.root}' for {silent:.0f} s "
            f"({first_line(exc)}), so this run stopped writing there before another could take "
            f"it over; check that {self.store.location} is reachable, then re-run to resume"
        )
        return True

    def _beat(self) -> bool | None:
        """Refresh the heartbeat if the lease is still ours: True once written; None if
        another writer held the lock (the next beat retries); False, and the lease lost, if
        another run holds it now."""
        current = self.store.read()
        if self._is_ours(current):
            beat = replace(self.record, beats=self.record.beats + 1, heartbeat_at=time.time())
            # Written only if the lease is still what we just read: a taker who replaced it
            # while this thread stalled keeps it.
            if self.store.replace(current, beat.to_bytes()):
                self.record = beat
                return True
            current = self.store.read()
            if self._is_ours(current):
                return None
        # Taken over; or deleted, maybe by a run that took it over and has finished.
        owner = current.record if current else None
        by = owner.owner() if owner else "a run that has released it since"
        self._lose(
            f"another run took over the lease of run directory '{self.root}' ({by}), so this "
            f"run stopped writing there; let that run finish, then re-run, or choose another "
            f"experiment.name"
        )
        return False

    def _lose(self, why: str) -> None:
        self.lost_reason = why
        self.lost.set()
        logger.error("lost the lease of run directory '%s': stopping the run", self.root)


class _Watch:
    """How long a lease has stayed the same, on this process's monotonic clock."""

    def __init__(self) -> None:
        self._raw: bytes | None = None
        self._since = 0.0
        self.changed = False  # seen to change while watched: its owner is at work
        self._announced = False

    def unchanged_for(self, raw: bytes) -> float:
        now = time.monotonic()
        if raw != self._raw:
            self.changed = self._raw is not None
            self._raw, self._since = raw, now
        return now - self._since

    def announce(self, root: str, found: StoredLease, stale_after_s: float) -> None:
        """Say once, after a moment, why the run waits instead of starting."""
        if self._announced or time.monotonic() - self._since < 1.0:
            return
        self._announced = True
        owner = found.record
        logger.info(
            "run directory '%s' has a lease of %s; waiting up to %.0f s for a heartbeat to "
            "tell whether it still runs",
            root,
            owner.owner() if owner else "an unknown owner",
            stale_after_s,
        )


@contextlib.contextmanager
def hold_run_lease(
    root: str,
    command: str,
    *,
    heartbeat_s: float | None = None,
    stale_after_s: float | None = None,
) -> Iterator[RunLease | None]:
    """Hold the lease on the run directory ``root`` while the body runs.

    Args:
        root: the run directory, resolved: an absolute local path or a URI.
        command: what writes there, ``train`` or ``tune`` (shown to a refused second run).
        heartbeat_s, stale_after_s: ``HEARTBEAT_S`` and ``STALE_AFTER_S`` unless given.

    Yields:
        The lease, or None where ``root``'s scheme has no lease (a warning says so). While
        the body runs, the run's workers stop at once if the lease is lost.

    Raises:
        BadInputError: another live run holds the directory (exit code 2).
        RunFailedError: another run took the lease over while the body ran (exit code 1).
    """
    store = lease_store(root)
    if store is None:
        yield None
        return
    lease = RunLease(
        store,
        root,
        _this_holder(command),
        heartbeat_s=HEARTBEAT_S if heartbeat_s is None else heartbeat_s,
        stale_after_s=STALE_AFTER_S if stale_after_s is None else stale_after_s,
    )
    with sigterm_exits_through_finally():
        lease.acquire()
        # What the run's workers (worker.stop_request) and check_lease_held read.
        told = lease_lost.set(lambda: lease.lost_reason)
        try:
            yield lease
            lease.check()  # a body that ended after losing the lease still fails
        except Exception as exc:
            if lease.lost_reason is None or str(exc) == lease.lost_reason:
                raise
            # Whatever the body failed with then (its workers stopped), the lost lease is why.
            raise RunFailedError(lease.lost_reason) from exc
        finally:
            lease_lost.reset(told)
            lease.release()


def check_lease_held() -> None:
    """Raise the one-line error if the lease held around this call was lost: call it before
    a write that ``hold_run_lease``'s body makes (nothing happens outside one)."""
    why = lease_lost.get()
    reason = why() if why else None
    if reason:
        raise RunFailedError(reason)


def refuse_if_held(root: str, command: str) -> None:
    """Refuse (exit code 2) when a live run holds ``root``, writing nothing (where no lease
    can be kept, ``hold_run_lease`` warns later)."""
    store = lease_store(root, warn=False)
    if store is not None:
        RunLease(store, root, _this_holder(command)).check_free()


def _this_holder(command: str) -> LeaseRecord:
    slurm = detect_slurm(os.environ)  # not detect_environment: its GPU probe imports torch
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
