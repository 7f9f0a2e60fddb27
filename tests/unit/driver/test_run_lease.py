"""One writer per run directory: the lease is created atomically, refuses a second live
holder in one line, is taken over from a gone owner (exactly one of racing takers wins), is
refreshed while held and released at the end; on a filesystem and on an S3 server.

A holder is judged gone by watching its lease stay unchanged on the reader's own clock,
never by its timestamps (another host's clock may be off), and a heartbeat writes only if
the lease is still its own: one that stalls while another run takes over loses, says so,
and the run fails instead of writing on."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from raytrain_app.driver import lease_stores, run_lease
from raytrain_app.driver.lease_stores import LEASE_FILE, FileLeaseStore, LeaseRecord, lease_store
from raytrain_app.driver.run_lease import hold_run_lease
from raytrain_app.errors import BadInputError, RunFailedError
from raytrain_app.testing.s3_server import s3_for_this_process

FAST = {"heartbeat_s": 0.05, "stale_after_s": 30.0}  # no test waits for the real minute
OWNER = re.compile(
    r"run directory '[^']+' is being written by raytrain (train|tune) on host \S+ "
    # The date shows when the holder started on another day than today (lease_stores._clock):
    # near midnight, a holder whose clock runs two minutes behind did.
    r"\(pid \d+(, SLURM job \S+)?, since (\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d\); "
    r"wait for it to finish, stop it, "
    r"or choose another experiment\.name"
)


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    """Outside SLURM unless a test says otherwise (the suite may run inside a job)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def lease_of(root: Path) -> LeaseRecord:
    record = LeaseRecord.from_bytes((root / LEASE_FILE).read_bytes())
    assert record is not None
    return record


def plant_record(**fields) -> LeaseRecord:
    now = time.time()
    return LeaseRecord(
        **{
            "token": "theirs",
            "command": "train",
            "host": "node7",
            "pid": 4242,
            "started_at": now - 300,
            "heartbeat_at": now,
            "heartbeat_s": 0.05,
            **fields,
        }
    )


def plant(root: Path, **fields) -> LeaseRecord:
    """Write a lease as another run would have left it (no heartbeat follows)."""
    record = plant_record(**fields)
    root.mkdir(parents=True, exist_ok=True)
    (root / LEASE_FILE).write_bytes(record.to_bytes())
    return record


class LiveHolder:
    """Another host's live run: beats the lease ``plant`` wrote every 10 ms (its timestamp
    shifted by ``skew`` seconds, as that host's clock may be) until the block ends."""

    def __init__(self, root: Path, skew: float = 0.0, **fields) -> None:
        self.root, self.skew, self.fields = root, skew, fields
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> LiveHolder:
        plant(self.root, heartbeat_at=time.time() + self.skew, **self.fields)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(5)

    def _beat(self) -> None:
        beats = 0
        while not self._done.wait(0.01):
            beats += 1
            fields = {"heartbeat_at": time.time() + self.skew, "beats": beats, **self.fields}
            record = plant_record(**fields)
            tmp = self.root / f"{LEASE_FILE}.beat.tmp"
            tmp.write_bytes(record.to_bytes())
            os.replace(tmp, self.root / LEASE_FILE)


def refusal(root: str, command: str = "train", **lease_args) -> str:
    """The one-line error of a run that may not take the lease of ``root``."""
    lease_args = {**FAST, **lease_args}
    with pytest.raises(BadInputError) as refused, hold_run_lease(root, command, **lease_args):
        pytest.fail(f"a second holder got the lease of {root}")
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped, so the PID names no process (not even a zombie)
    return child.pid


def lease_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("run-lease")]


def test_the_first_run_creates_the_lease_exclusively_and_removes_it_at_the_end(tmp_path):
    root = tmp_path / "runs" / "exp"
    with hold_run_lease(str(root), "train", **FAST) as lease:
        held = lease_of(root)
        assert (held.host, held.pid, held.command) == (socket.gethostname(), os.getpid(), "train")
        assert held.token == lease.record.token and held.slurm_job_id is None
        assert time.time() - 5 < held.started_at <= held.heartbeat_at
        assert FileLeaseStore(root).create(b"{}") is False  # exclusive: the file is there
        assert lease_threads()
    assert not (root / LEASE_FILE).exists()
    assert not root.exists()  # the lease made the directory and nothing else was written
    assert lease_threads() == []


def test_a_second_run_is_refused_in_one_line_naming_the_owner(tmp_path):
    root = tmp_path / "exp"
    with hold_run_lease(str(root), "train", **FAST):
        first = lease_of(root)
        message = refusal(str(root), "tune")
        assert lease_of(root).token == first.token  # the first run's lease is untouched
    assert OWNER.fullmatch(message), message
    assert f"'{root}'" in message and f"pid {os.getpid()}," in message
    assert f"on host {socket.gethostname()} " in message


def test_a_lease_whose_heartbeat_changes_it_on_another_host_is_refused(tmp_path):
    root = tmp_path / "exp"
    with LiveHolder(root, slurm_job_id="77"):
        assert "on host node7 (pid 4242, SLURM job 77, since" in refusal(str(root))
        assert lease_of(root).token == "theirs"


@pytest.mark.parametrize("skew", [-120.0, 120.0])
def test_a_live_holder_whose_clock_is_minutes_off_is_not_taken_over(tmp_path, skew):
    """Its heartbeat's timestamps are two minutes in the past (or future) by this clock:
    the lease changes, so its owner runs. (Before: a past one was taken over at once.)"""
    root = tmp_path / "exp"
    with LiveHolder(root, skew=skew):
        message = refusal(str(root), heartbeat_s=0.05, stale_after_s=1.0)
        assert OWNER.fullmatch(message), message
        assert lease_of(root).token == "theirs"
        with pytest.raises(BadInputError, match="is being written by raytrain train on host node7"):
            run_lease.refuse_if_held(str(root), "train")


@pytest.mark.parametrize("skew", [-120.0, 0.0, 120.0])
def test_a_lease_seen_unchanged_for_the_stale_interval_is_taken_over_whatever_its_clock(
    tmp_path, caplog, skew
):
    """A holder on another host that stopped beating is gone once this process has watched
    its lease stay the same for stale_after_s, however fresh (or old) its timestamp looks.
    (Before: a fresh or future timestamp was never taken over; an old one at once.)"""
    root = tmp_path / "exp"
    plant(root, heartbeat_at=time.time() + skew)
    start = time.monotonic()
    with (
        caplog.at_level(logging.WARNING),
        hold_run_lease(str(root), "train", heartbeat_s=0.05, stale_after_s=0.5) as lease,
    ):
        assert time.monotonic() - start >= 0.5
        assert lease_of(root).token == lease.record.token
    assert re.search(
        r"taking over .* from raytrain train on host node7 .*: its lease has not changed for "
        r"\d+ s \(no heartbeat\)",
        caplog.text,
    )


def test_the_check_before_ray_starts_refuses_a_held_lease_and_writes_nothing(tmp_path):
    root = tmp_path / "exp"
    # The check watches for two of the owner's heartbeats: 2 s here, which the holder
    # (beating every 10 ms) fills even when starved of CPU (the compatibility tier runs in
    # the idle class beside the main suite; 0.1 s was missed there once).
    with LiveHolder(root, heartbeat_s=1.0), pytest.raises(BadInputError) as refused:
        run_lease.refuse_if_held(str(root), "train")
    assert OWNER.fullmatch(str(refused.value)), refused.value
    assert sorted(p.name for p in root.iterdir()) == [LEASE_FILE]
    assert lease_of(root).token == "theirs"
    # A lease that did not change while it watched two of its owner's heartbeats is left
    # for the lease itself to judge (it watches on for the stale interval).
    plant(root)
    run_lease.refuse_if_held(str(root), "train")
    # A lease whose process died here, or no run directory at all, passes and stays as is.
    plant(root, host=socket.gethostname(), pid=dead_pid())
    run_lease.refuse_if_held(str(root), "train")
    absent = tmp_path / "runs" / "new"
    run_lease.refuse_if_held(str(absent), "train")
    assert not (tmp_path / "runs").exists()


def test_a_lease_whose_process_died_on_this_host_is_taken_over(tmp_path, caplog):
    root = tmp_path / "exp"
    plant(root, host=socket.gethostname(), pid=dead_pid())
    with caplog.at_level(logging.WARNING), hold_run_lease(str(root), "train", **FAST) as lease:
        assert lease_of(root).token == lease.record.token
    assert any(
        r.levelno == logging.WARNING and "taking over" in r.message and "has exited" in r.message
        for r in caplog.records
    )
    assert not (root / LEASE_FILE).exists()


def test_a_lease_of_the_same_slurm_job_is_taken_over_as_a_requeue(tmp_path, monkeypatch, caplog):
    root = tmp_path / "exp"
    plant(root, slurm_job_id="9001")  # another node, fresh heartbeat: the job's first run
    monkeypatch.setenv("SLURM_JOB_ID", "9001")
    with caplog.at_level(logging.WARNING), hold_run_lease(str(root), "train", **FAST) as lease:
        held = lease_of(root)
        assert held.token == lease.record.token and held.slurm_job_id == "9001"
    assert "SLURM job (9001), requeued" in caplog.text


def test_another_slurm_job_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "exp"
    monkeypatch.setenv("SLURM_JOB_ID", "9002")
    with LiveHolder(root, slurm_job_id="9001"):
        assert "SLURM job 9001" in refusal(str(root))


def _take_over(root: str, start: threading.Barrier, done: threading.Event, outcomes: list) -> None:
    start.wait()
    try:
        with hold_run_lease(root, "train", **FAST):
            outcomes.append("won")
            done.wait(20)  # hold it until every other taker has had its try
    except BadInputError as exc:
        outcomes.append("refused" if OWNER.fullmatch(str(exc)) else str(exc))


@pytest.mark.parametrize("round_", range(5))
def test_of_threads_racing_to_take_over_a_stale_lease_exactly_one_wins(tmp_path, round_):
    root = tmp_path / "exp"
    plant(root, host=socket.gethostname(), pid=dead_pid())
    takers, outcomes, done = 6, [], threading.Event()
    start = threading.Barrier(takers)
    threads = [
        threading.Thread(target=_take_over, args=(str(root), start, done, outcomes))
        for _ in range(takers)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(outcomes) < takers and time.monotonic() < deadline:
        time.sleep(0.01)
    done.set()
    for thread in threads:
        thread.join(20)
    assert sorted(outcomes) == ["refused"] * (takers - 1) + ["won"]
    assert list(root.iterdir()) == []  # released; no takeover lock or temp file left


def _take_over_in_a_process(root: str, start, done, results) -> None:
    start.wait()
    try:
        with hold_run_lease(root, "train", heartbeat_s=0.05, stale_after_s=0.5):
            results.put("won")
            done.wait(20)
    except BadInputError:
        results.put("refused")


def test_of_processes_racing_to_take_over_a_stale_lease_exactly_one_wins(tmp_path):
    root = tmp_path / "exp"
    plant(root)  # another host, silent from now on: each taker watches it for 0.5 s
    context = multiprocessing.get_context("fork")  # the children skip importing torch again
    takers = 4
    start, done, results = context.Barrier(takers), context.Event(), context.Queue()
    children = [
        context.Process(target=_take_over_in_a_process, args=(str(root), start, done, results))
        for _ in range(takers)
    ]
    for child in children:
        child.start()
    try:
        outcomes = [results.get(timeout=60) for _ in range(takers)]
    finally:
        done.set()
        for child in children:
            child.join(30)
    assert sorted(outcomes) == ["refused"] * (takers - 1) + ["won"]
    assert [child.exitcode for child in children] == [0] * takers


def test_two_takers_of_the_same_stale_version_cannot_both_replace_it(tmp_path):
    root = tmp_path / "exp"
    plant(root, heartbeat_at=0.0)
    first, second = FileLeaseStore(root), FileLeaseStore(root)
    stale = first.read()
    assert stale is not None
    assert first.replace(stale, b"first") is True
    assert second.replace(stale, b"second") is False  # it changed after the second's read
    assert (root / LEASE_FILE).read_bytes() == b"first"


def test_a_taker_waits_for_another_takers_lock_and_removes_an_abandoned_one(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(lease_stores, "_ABANDONED_LOCK_S", 0.2)
    root = tmp_path / "exp"
    plant(root, heartbeat_at=0.0)
    (root / f"{LEASE_FILE}.lock").touch()  # a taker that died holding its lock
    store = FileLeaseStore(root)
    stale = store.read()
    assert stale is not None
    assert store.replace(stale, b"mine") is False  # another taker is at work
    time.sleep(0.3)
    with caplog.at_level(logging.WARNING):
        assert store.replace(stale, b"mine") is False  # the lock is abandoned: removed
    assert "abandoned lease lock" in caplog.text
    assert store.replace(stale, b"mine") is True
    assert sorted(p.name for p in root.iterdir()) == [LEASE_FILE]


def test_an_unreadable_lease_is_taken_over_once_seen_unchanged_and_refused_while_it_changes(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(run_lease, "_UNREADABLE_GRACE_S", 0.2)
    monkeypatch.setattr(run_lease, "_CLAIM_TIMEOUT_S", 0.3)
    root = tmp_path / "exp"
    root.mkdir()
    path = root / LEASE_FILE
    done = threading.Event()

    def scribble() -> None:  # a writer at work on a lease nobody can read
        for n in range(10**6):
            if done.wait(0.01):
                return
            (root / "scribble.tmp").write_bytes(b"{" * (n % 7 + 1))
            os.replace(root / "scribble.tmp", path)

    path.write_bytes(b"")
    writer = threading.Thread(target=scribble)
    writer.start()
    try:
        message = refusal(str(root), stale_after_s=0.2)
    finally:
        done.set()
        writer.join(5)
    assert "keeps changing or cannot be read" in message
    path.write_bytes(b"")  # a writer that died before writing a byte: unchanged from now on
    # Time enough to see it unchanged for the grace period on a starved CPU (the
    # compatibility tier runs in the idle class beside the suite: 0.3 s was seen to pass).
    monkeypatch.setattr(run_lease, "_CLAIM_TIMEOUT_S", 10.0)
    with hold_run_lease(str(root), "train", heartbeat_s=0.05, stale_after_s=0.5) as lease:
        assert lease_of(root).token == lease.record.token


def test_sigterm_ends_the_run_through_the_release(tmp_path):
    root = tmp_path / "exp"
    # SIGTERM at its default, as in a fresh `raytrain` process: a Ray driver that ran
    # earlier in this test process (`pytest -n 2` runs unit tests after a tier) leaves
    # Ray's own handler behind.
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as ended, hold_run_lease(str(root), "train", **FAST):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at the next bytecode
        assert ended.value.code == 128 + signal.SIGTERM
        assert not (root / LEASE_FILE).exists()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_exception_in_the_run_releases_the_lease_and_stops_the_heartbeat(tmp_path):
    root = tmp_path / "exp"
    root.mkdir()
    (root / "config.yaml").write_text("x: 1\n")
    with pytest.raises(RuntimeError, match="boom"), hold_run_lease(str(root), "train", **FAST):
        raise RuntimeError("boom")
    assert sorted(p.name for p in root.iterdir()) == ["config.yaml"]  # the directory stays
    assert lease_threads() == []
    with hold_run_lease(str(root), "train", **FAST):  # and the next run gets it at once
        pass


def test_the_heartbeat_refreshes_the_lease_while_it_is_held(tmp_path):
    root = tmp_path / "exp"
    with hold_run_lease(str(root), "tune", **FAST) as lease:
        first = lease_of(root)
        deadline = time.monotonic() + 10
        while lease_of(root).beats < first.beats + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        later = lease_of(root)
        assert later.beats >= first.beats + 2 and later.heartbeat_at > first.heartbeat_at
        assert (later.token, later.started_at) == (first.token, first.started_at)
        assert later.heartbeat_s == 0.05
        assert not lease.lost.is_set()


LOST = re.compile(
    r"another run took over the lease of run directory '[^']+' \((raytrain train on host node7 "
    r"\(pid 4242, since [^)]+\)|a run that has released it since)\), so this run stopped "
    r"writing there; let that run finish, then re-run, or choose another experiment\.name"
)


@pytest.mark.parametrize("taken", ["replaced", "deleted"])
def test_a_run_whose_lease_was_taken_fails_in_one_line_naming_the_directory(
    tmp_path, caplog, taken
):
    """Replaced by a taker, or gone (a taker that has finished released it): either way
    another run wrote there, and the body's end raises instead of returning normally."""
    root = tmp_path / "exp"
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(RunFailedError) as lost,
        hold_run_lease(str(root), "train", **FAST) as lease,
    ):
        if taken == "replaced":
            plant(root)  # as if a taker had judged us gone
        else:
            (root / LEASE_FILE).unlink()
        assert lease.lost.wait(10)
        with pytest.raises(RunFailedError):
            lease.check()  # what the driver calls before it writes
    assert LOST.fullmatch(str(lost.value)), lost.value
    assert f"'{root}'" in str(lost.value)
    assert f"lost the lease of run directory '{root}': stopping the run" in caplog.text
    if taken == "replaced":
        assert lease_of(root).token == "theirs"  # not ours to delete
    else:
        assert not (root / LEASE_FILE).exists()  # and not recreated by a heartbeat


def test_a_run_that_cannot_beat_for_half_the_stale_interval_stops_before_a_taker_could_start(
    tmp_path,
):
    """Storage unreachable from this run (not from others): a taker would take over after
    watching the lease unchanged for the stale interval, so this run gives up first.
    (Before: it warned and went on writing.)"""
    root = tmp_path / "exp"

    def unreachable():
        raise OSError("Stale file handle")

    with (
        pytest.raises(RunFailedError) as lost,
        hold_run_lease(str(root), "train", heartbeat_s=0.05, stale_after_s=0.4) as lease,
    ):
        lease.store.read = unreachable
        assert lease.lost.wait(10)
        del lease.store.read  # reachable again for the release
    message = str(lost.value)
    assert message.startswith(f"could not refresh the lease of run directory '{root}' for ")
    assert message.endswith(
        f"(Stale file handle), so this run stopped writing there before another could take "
        f"it over; check that {root / LEASE_FILE} is reachable, then re-run to resume"
    )


def test_an_error_in_a_run_that_lost_its_lease_is_reported_as_the_lost_lease(tmp_path):
    """Its workers were stopped for it, so whatever the body raised, the lease is why."""
    root = tmp_path / "exp"
    with (
        pytest.raises(RunFailedError) as lost,
        hold_run_lease(str(root), "train", **FAST) as lease,
    ):
        plant(root)
        assert lease.lost.wait(10)
        raise RuntimeError("a worker group that was stopped")
    assert LOST.fullmatch(str(lost.value)), lost.value
    assert isinstance(lost.value.__cause__, RuntimeError)


def test_an_unwritable_output_dir_fails_in_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "runs").write_text("a file where experiment.output_dir should be\n")
    message = refusal(str(tmp_path / "runs" / "exp"))
    assert message.startswith(f"cannot write the lease of run directory '{tmp_path}/runs/exp'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_other_uri_schemes_run_unguarded_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING), hold_run_lease("gs://bucket/runs/exp", "train") as got:
        assert got is None
    assert "no lease guards run directory 'gs://bucket/runs/exp'" in caplog.text


def test_s3_without_boto3_fails_in_one_line_saying_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    with pytest.raises(BadInputError, match=r"pip install boto3") as missing:
        lease_store("s3://bucket/runs/exp")
    assert "\n" not in str(missing.value)


# --- S3: a real protocol server (moto), which honours If-None-Match and If-Match -------------


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server; this process's AWS_* variables point at it."""
    with s3_for_this_process("leases") as server:
        yield server


def test_on_s3_a_missing_bucket_fails_in_one_line(s3):
    assert "cannot write the lease" in refusal("s3://no-such-bucket/runs/exp")


def s3_object(key: str) -> bytes | None:
    import boto3

    client = boto3.session.Session().client("s3")
    try:
        return client.get_object(Bucket="leases", Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        return None


def test_on_s3_a_second_run_is_refused_and_release_deletes_the_object(s3):
    root = s3.uri("runs", "exp")
    with hold_run_lease(root, "train", **FAST) as lease:
        held = LeaseRecord.from_bytes(s3_object(f"runs/exp/{LEASE_FILE}") or b"")
        assert held is not None and held.token == lease.record.token
        message = refusal(root)
    assert OWNER.fullmatch(message) and f"'{root}'" in message
    assert s3_object(f"runs/exp/{LEASE_FILE}") is None


def test_on_s3_the_create_is_conditional_and_a_stale_lease_has_one_taker(s3):
    store = lease_store(s3.uri("runs", "race"))
    assert store is not None
    assert store.create(b"one") is True
    assert store.create(b"two") is False  # If-None-Match: * refused by the server (412)
    stale = store.read()
    assert stale is not None and stale.raw == b"one"
    assert store.replace(stale, b"first taker") is True  # If-Match: the stale ETag
    assert store.replace(stale, b"second taker") is False  # that ETag is gone now
    assert s3_object(f"runs/race/{LEASE_FILE}") == b"first taker"
    store.delete(stale)  # If-Match: a stale version deletes nothing
    assert s3_object(f"runs/race/{LEASE_FILE}") == b"first taker"
    store.delete(store.read())
    assert s3_object(f"runs/race/{LEASE_FILE}") is None


def test_on_s3_a_stale_lease_is_taken_over_and_the_heartbeat_refreshes_it(s3):
    root = s3.uri("runs", "requeued")
    store = lease_store(root)
    assert store is not None
    gone = LeaseRecord("theirs", "train", "node7", 4242, 0.0, time.time() - 5.0)
    assert store.create(gone.to_bytes())
    with hold_run_lease(root, "train", heartbeat_s=0.05, stale_after_s=1.0) as lease:
        first = LeaseRecord.from_bytes(store.read().raw)
        assert first is not None and first.token == lease.record.token
        deadline = time.monotonic() + 10
        while LeaseRecord.from_bytes(store.read().raw).heartbeat_at == first.heartbeat_at:
            assert time.monotonic() < deadline, "the heartbeat never refreshed the S3 lease"
            time.sleep(0.05)
    assert store.read() is None


# --- a heartbeat that stalls while another run takes over: on a filesystem and on S3 --------


class StalledRead:
    """Stalls ``lease``'s heartbeat once, between its read and its write: its next read of
    the lease returns only when ``resume`` is set."""

    def __init__(self, lease: run_lease.RunLease) -> None:
        self.stalled, self.resume = threading.Event(), threading.Event()
        self._read = lease.store.read
        self._armed = True
        lease.store.read = self  # this holder's store only

    def __call__(self):
        found = self._read()
        if self._armed and threading.current_thread().name.startswith("run-lease"):
            self._armed = False
            self.stalled.set()
            self.resume.wait(30)
        return found


@pytest.fixture(params=["file", "s3"])
def lease_root(request, tmp_path):
    """A run directory on a filesystem or on the S3 server, and how to read its lease's token."""
    if request.param == "file":
        root = tmp_path / "exp"
        return str(root), lambda: lease_of(root).token
    s3 = request.getfixturevalue("s3")
    name = f"stalled-{uuid.uuid4().hex[:8]}"
    key = f"runs/{name}/{LEASE_FILE}"

    def token() -> str:
        record = LeaseRecord.from_bytes(s3_object(key) or b"")
        assert record is not None
        return record.token

    return s3.uri("runs", name), token


def test_a_heartbeat_stalled_between_its_read_and_write_loses_to_a_takeover(lease_root):
    """Holder A's heartbeat reads its lease and stalls; B, seeing the lease unchanged for the
    stale interval, takes it over. A's write, when it comes, must not undo B's lease, and A
    must learn that it lost. (Before: on a filesystem, A's write replaced B's lease.)"""
    root, token = lease_root
    fast = {"heartbeat_s": 0.05, "stale_after_s": 0.5}
    with pytest.raises(RunFailedError) as lost, hold_run_lease(root, "train", **fast) as a:
        stall = StalledRead(a)
        assert stall.stalled.wait(10)
        time.sleep(0.6)  # A's last beat is older than B's stale interval: B watches it
        with hold_run_lease(root, "train", **fast) as b:
            assert token() == b.record.token
            stall.resume.set()
            assert a.lost.wait(10), "the stalled holder never learned that it lost"
            time.sleep(0.3)  # B beats on; A's late write has had its chance
            assert token() == b.record.token
            assert not b.lost.is_set()
    message = str(lost.value)
    assert message.startswith(f"another run took over the lease of run directory '{root}' ")
    assert f"raytrain train on host {socket.gethostname()} (pid {os.getpid()}, since" in message
    assert "\n" not in message


def test_a_file_swap_stalled_inside_its_lock_writes_nothing_once_its_lock_was_taken(
    tmp_path, monkeypatch
):
    """A stall after taking the lock, long enough for a taker to judge the lock abandoned
    and take it: the stalled writer backs out instead of replacing the taker's lease.
    (Before: its write landed over the taker's.)"""
    monkeypatch.setattr(lease_stores, "_ABANDONED_LOCK_S", 0.2)
    root = tmp_path / "exp"
    plant(root)
    stalled_store, taker = FileLeaseStore(root), FileLeaseStore(root)
    expected = stalled_store.read()
    assert expected is not None
    stall = StalledRead(run_lease.RunLease(stalled_store, str(root), plant_record()))
    outcome: list[bool] = []
    writer = threading.Thread(
        target=lambda: outcome.append(stalled_store.replace(expected, b"stalled")),
        name="run-lease stalled",  # what StalledRead stalls
    )
    writer.start()
    assert stall.stalled.wait(5)
    deadline = time.monotonic() + 10
    while not taker.replace(expected, b"taker"):  # busy, then abandoned, then taken
        assert time.monotonic() < deadline, "the taker never got the abandoned lock"
        time.sleep(0.05)
    stall.resume.set()
    writer.join(10)
    assert outcome == [False]
    assert (root / LEASE_FILE).read_bytes() == b"taker"
    assert sorted(p.name for p in root.iterdir()) == [LEASE_FILE]  # no lock or temp file left
