"""The garbage collector held off while a worker starts (raytrain_app.startup_gc), run in
this process with one worker (no Ray); its effect on the first step is measured in
benchmarks/first_step.py, not here."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import time

import pytest
from loop_harness import Crash, LocalSession, make_task, run_loop

from raytrain_app import startup_gc
from raytrain_app.worker import loop as loop_module
from raytrain_app.worker.telemetry import StepTelemetry


@pytest.fixture(autouse=True)
def collector_restored():
    """Each test starts with the collector on and nothing paused, and leaves it so."""
    startup_gc.resume()
    gc.enable()
    yield
    startup_gc.resume()
    gc.enable()


def _unpickled_on_a_worker(task):
    """What a worker does with the train-loop config the driver builds (driver.trainer)."""
    return pickle.loads(pickle.dumps({"startup": startup_gc.PauseOnArrival(), "task": task}))


def test_unpickling_the_config_pauses_the_collector_until_the_first_step_is_done(
    tmp_path, monkeypatch
):
    config = _unpickled_on_a_worker(make_task(tmp_path, epochs=1))
    assert not gc.isenabled()  # before the task's own modules and objects arrive

    during_setup = []
    build_worker = loop_module.build_worker

    def recording_build(*args, **kwargs):
        during_setup.append(gc.isenabled())
        return build_worker(*args, **kwargs)

    after_each_step = []
    after_step = StepTelemetry.after_step

    def recording_after_step(self, *args, **kwargs):
        after_each_step.append(gc.isenabled())
        return after_step(self, *args, **kwargs)

    monkeypatch.setattr(loop_module, "build_worker", recording_build)
    monkeypatch.setattr(StepTelemetry, "after_step", recording_after_step)
    result, _ = run_loop(config["task"], LocalSession(tmp_path / "ckpt"))

    assert during_setup == [False]
    # Off through the first step (its telemetry included), on from the second on.
    assert len(after_each_step) > 1 and result["history"][0]["epoch"] == 1
    assert after_each_step[0] is False and all(after_each_step[1:])
    assert gc.isenabled()


def test_a_worker_that_fails_before_its_first_step_gets_its_collector_back(tmp_path, monkeypatch):
    config = _unpickled_on_a_worker(make_task(tmp_path, epochs=1))

    def failing_build(*args, **kwargs):
        raise Crash

    monkeypatch.setattr(loop_module, "build_worker", failing_build)
    with pytest.raises(Crash):
        run_loop(config["task"], LocalSession(tmp_path / "ckpt"))
    assert gc.isenabled()


def test_a_local_run_that_fails_before_its_loop_gets_its_collector_back(monkeypatch):
    """``raytrain train --local`` pauses from the training function's start, in the caller's
    own process (a notebook's, a test session's); a failure before the worker loop runs,
    which would resume it, resumes it too."""
    from raytrain_app.driver import local_run

    def fails_in_set_up(*args):
        assert not gc.isenabled()  # paused from the training function's start
        raise RuntimeError("set-up failed")

    monkeypatch.setattr(local_run, "train_worker_local", fails_in_set_up)
    with pytest.raises(RuntimeError, match="set-up failed"):
        local_run._local_entry({"task": None, "checkpoints": None, "retention": None})
    assert gc.isenabled()


def test_a_collector_the_process_turned_off_itself_stays_off():
    gc.disable()
    startup_gc.pause()
    startup_gc.resume()
    assert not gc.isenabled()
    with startup_gc.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_block_inside_a_pause_leaves_the_pause_to_its_owner():
    startup_gc.pause()
    with startup_gc.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # still the first pause's: the worker's first step ends it
    startup_gc.resume()
    assert gc.isenabled()
    with startup_gc.paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_copying_the_config_in_the_driver_pauses_nothing():
    config = {"startup": startup_gc.PauseOnArrival(), "task": None}
    copy.deepcopy(config)
    copy.copy(config["startup"])
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
def test_a_process_forked_during_the_pause_gets_its_collector_back_at_once():
    # A DataLoader's worker processes are forked in set-up, before the first step, and
    # never reach it: they must not run without their collector.
    startup_gc.pause()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, b"1" if gc.isenabled() else b"0")
        os._exit(0)
    os.close(write)
    enabled_in_child = os.read(read, 1)
    os.close(read)
    os.waitpid(child, 0)
    assert enabled_in_child == b"1"
    assert not gc.isenabled()  # the parent's pause goes on until its first step


def test_a_pause_nobody_ends_ends_by_itself(monkeypatch):
    # A process that unpickles the config but never trains (a controller actor) must not
    # run without its collector for the rest of its life.
    monkeypatch.setattr(startup_gc, "_LONGEST_PAUSE_S", 0.05)
    pickle.loads(pickle.dumps(startup_gc.PauseOnArrival()))
    assert not gc.isenabled()
    deadline = time.monotonic() + 5
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gc.isenabled()
