"""A run that loses its directory's lease stops writing there at once and exits 1 in one
line; the config check runs again under the lease. End to end through ``raytrain train
--local`` (Ray Train's local mode: the driver and the worker in this process), and the
pieces that carry the news to workers on Ray (run control, stop request)."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import yaml
from fault_runs import fault_config, newest_step

from raytrain_app import cli
from raytrain_app.config import config_from_dict, config_with_values, dump_config_yaml
from raytrain_app.driver import run_control, run_lease, training
from raytrain_app.driver.lease_stores import LEASE_FILE, LeaseRecord, lease_store
from raytrain_app.errors import BadInputError, RunFailedError
from raytrain_app.planning.environment import detect_environment
from raytrain_app.testing.s3_server import s3_for_this_process
from raytrain_app.worker import stop_request
from raytrain_app.worker.stop_request import StopRequest, lease_lost

THEIRS = LeaseRecord("theirs", "train", "node7", 4242, time.time(), time.time())


@pytest.fixture(autouse=True)
def fast_lease(monkeypatch):
    """A heartbeat every 50 ms, and the environment as it was (a run sets Ray's defaults)."""
    monkeypatch.setattr(run_lease, "HEARTBEAT_S", 0.05)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _config_file(tmp_path: Path, output_dir: str, name: str) -> Path:
    cfg = fault_config(output_dir, name, epochs=4, sleep_s=0.02)  # 200 steps, 20 checkpoints
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class RunDir:
    """A run directory on a filesystem or on the S3 server: its newest checkpoint's step,
    its files, and another run taking its lease over as a taker does (compare-and-swap)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.store = lease_store(uri)

    def newest_step(self) -> int:
        if "://" not in self.uri:
            return newest_step(Path(self.uri))
        steps = [int(m.group(1)) for key in self._keys() if (m := _CHECKPOINT.search(key))]
        return max(steps, default=0)

    def names(self) -> set[str]:
        if "://" not in self.uri:
            return {p.name for p in Path(self.uri).iterdir()}
        return {key.split("/")[2] for key in self._keys()}

    def lease_token(self) -> str:
        found = self.store.read()
        return found.record.token if found and found.record else ""

    def take_over_after_first_checkpoint(self, taken: list[int]) -> None:
        deadline = time.monotonic() + 120
        while self.newest_step() == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        # Retried: the holder's heartbeat may change the lease between a read and a swap.
        while time.monotonic() < deadline:
            found = self.store.read()
            if found is None:
                return  # the run ended first
            if self.store.replace(found, THEIRS.to_bytes()):
                taken.append(self.newest_step())
                return

    def _keys(self) -> list[str]:
        import boto3

        _, _, rest = self.uri.partition("://")
        bucket, _, prefix = rest.partition("/")
        pages = boto3.session.Session().client("s3").get_paginator("list_objects_v2")
        found = pages.paginate(Bucket=bucket, Prefix=f"{prefix}/")
        return [entry["Key"] for page in found for entry in page.get("Contents", [])]


_CHECKPOINT = re.compile(r"_step(\d+)/")


@pytest.fixture(scope="module")
def s3():
    with s3_for_this_process("lost") as server:
        yield server


@pytest.mark.parametrize("storage", ["file", "s3"])
def test_a_local_run_whose_lease_is_taken_over_stops_writing_and_exits_1_in_one_line(
    request, tmp_path, monkeypatch, capsys, storage
):
    """Before: the run logged that it lost the lease and trained on to the end, writing
    checkpoints, metrics and a summary into the other run's directory, and exited 0."""
    output_dir = (
        str(tmp_path / "runs") if storage == "file" else request.getfixturevalue("s3").uri("runs")
    )
    config = _config_file(tmp_path, output_dir, "taken")
    run = RunDir(f"{output_dir}/taken")
    at_loss: list[int] = []  # the newest checkpoint when the run learned it lost the lease
    lose = run_lease.RunLease._lose

    def noting_the_step(self, why: str) -> None:
        at_loss.append(run.newest_step())
        lose(self, why)

    monkeypatch.setattr(run_lease.RunLease, "_lose", noting_the_step)
    taken: list[int] = []
    taker = threading.Thread(target=run.take_over_after_first_checkpoint, args=(taken,))
    taker.start()
    code = cli.main(["train", "--local", "--no-progress", "--config", str(config)])
    taker.join(10)
    err = capsys.readouterr().err
    assert taken and at_loss, "the lease was never taken over or never found lost"
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"error: another run took over the lease of run directory '{run.uri}' (raytrain train "
        f"on host node7 (pid 4242, since "
    ), err
    assert last.endswith("let that run finish, then re-run, or choose another experiment.name")
    assert "Traceback" not in err
    # It stopped: at most the checkpoint of the step it was in when it learned, no summary,
    # and the taker's lease left in place.
    assert run.newest_step() <= at_loss[0] + 10 < 4 * 50
    assert "summary.json" not in run.names()
    assert run.lease_token() == "theirs"


def test_the_config_check_is_repeated_under_the_lease(tmp_path, monkeypatch):
    """Two runs of one experiment with different configs both pass the check before the
    lease; the first takes the lease, writes its config.yaml (and finishes) before the
    second gets the lease. The second must refuse then, not train over the first's run.
    (Before: the only check came before the lease, and the second trained.)"""
    config = _config_file(tmp_path, str(tmp_path / "runs"), "raced")
    run_dir = tmp_path / "runs" / "raced"
    cfg = config_from_dict(yaml.safe_load(config.read_text()))
    acquire = run_lease.RunLease.acquire

    def first_run_wins_the_race(self) -> None:
        other = config_with_values(cfg, {"train.lr": 0.5})
        first = training.resolve_config(other, training.make_plan(other, detect_environment()))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config_yaml(first))
        acquire(self)

    trained: list[bool] = []
    monkeypatch.setattr(run_lease.RunLease, "acquire", first_run_wins_the_race)
    monkeypatch.setattr(training, "run_training", lambda *args, **kwargs: trained.append(True))
    with pytest.raises(BadInputError, match=r"already holds a run .* with a different config"):
        training.train(cfg, local=True, progress=False)
    assert trained == []
    assert not (run_dir / LEASE_FILE).exists()  # released


# --- how the news reaches the workers ---------------------------------------------------------


def test_in_local_mode_rank_zero_raises_at_its_next_step_once_the_lease_is_lost():
    """The worker runs in the driver's thread: its stop request reads the lease directly,
    ahead of a stop signal (which would write a checkpoint first)."""
    why: list[str] = []
    told = lease_lost.set(lambda: why[0] if why else None)
    try:
        signal_flag = threading.Event()
        rank_zero = StopRequest(signal_flag, rank_zero=True)
        other_rank = StopRequest(signal_flag, rank_zero=False)
        assert rank_zero.requested() is False
        why.append("another run took over the lease of run directory '/r' (...)")
        signal_flag.set()
        with pytest.raises(RunFailedError, match=r"^another run took over the lease of"):
            rank_zero.requested()
        assert other_rank.requested() is False  # it stops with the failed worker group
    finally:
        lease_lost.reset(told)


class AnsweringControl:
    """Stands in for the RunControl actor's handle: every question is an object ref, whose
    answer ``ray.get`` (replaced) looks up."""

    def __init__(self, answer: tuple[bool, str | None]) -> None:
        self.answers: dict[object, tuple[bool, str | None]] = {}
        self.requests = self
        self.answer = answer

    def remote(self) -> object:
        ref = object()
        self.answers[ref] = self.answer
        return ref


@pytest.mark.parametrize("answer", [(False, "another run took over the lease"), (True, None)])
def test_rank_zero_asks_the_run_control_at_once_and_waits_only_before_it_first_writes(
    monkeypatch, answer
):
    control, waited = AnsweringControl(answer), []
    monkeypatch.setattr(stop_request, "_is_actor", lambda handle: handle is control)
    import ray

    monkeypatch.setattr(ray, "get", lambda ref: waited.append(ref) or control.answers[ref])
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: (refs, []))
    request = StopRequest(control, rank_zero=True)
    # Asked while the worker builds its model, not waited for on the way to the first step.
    assert len(control.answers) == 1 and waited == []
    if answer[1]:  # a worker group restarted after the lease was lost writes nothing
        with pytest.raises(RunFailedError, match="took over the lease"):
            request.confirm_lease()
        return
    request.confirm_lease()
    assert waited == list(control.answers)
    assert request.requested() is True  # a stop asked before the start is not lost
    assert StopRequest(control, rank_zero=False).confirm_lease() is None  # others never ask
    assert len(control.answers) == 1


class RecordingActor:
    """Stands in for the RunControl actor: records the driver's calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, method: str):
        actor = self

        class Method:
            @staticmethod
            def remote(*args):
                actor.calls.append((method, args))

        return Method


def test_on_ray_the_driver_control_passes_a_lost_lease_on_to_the_workers_once():
    why: list[str] = []
    told = lease_lost.set(lambda: why[0] if why else None)
    try:
        control = run_control.DriverControl(progress=False)
    finally:
        lease_lost.reset(told)
    control.actor = RecordingActor()
    thread = threading.Thread(target=control._run)
    thread.start()
    try:
        time.sleep(0.7)
        assert control.actor.calls == []
        why.append("lost")
        deadline = time.monotonic() + 10
        while not control.actor.calls and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)
    finally:
        control._done.set()
        thread.join(5)
    assert control.actor.calls == [("lose_lease", ("lost",))]


def test_the_run_control_answers_a_stop_and_a_lost_lease():
    state = run_control.RunControl.__ray_actor_class__()
    assert state.requests() == (False, None)
    state.request_stop()
    state.lose_lease("lost")
    assert state.requests() == (True, "lost")
