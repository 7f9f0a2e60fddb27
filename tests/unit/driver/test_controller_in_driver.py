"""Ray Train's controller in the driver (``driver.controller_in_driver``): how the driver
waits for it, what the workers get for its handle, and that the one Ray method raytrain
re-states is still Ray's. No Ray runs here: the controller is a stand-in. Real runs with
it: every training run of tests/distributed and tests/cluster (test_faults: a worker
killed mid-save, a hung collective; test_signals: Ctrl-C and SIGKILL; SLURM preemption,
a lost node, elastic resizes, Ray jobs)."""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import re
import signal
import threading
import time
from contextlib import contextmanager
from typing import ClassVar

import pytest
import ray

from raytrain_app.driver import controller_in_driver, ray_internals
from raytrain_app.driver.controller_in_driver import _NoControllerActor, run_controller_in_driver


class _StandInController:
    """Runs until told to finish or aborted; records what it was given and asked."""

    instances: ClassVar[list[_StandInController]] = []
    building = threading.Event()  # a controller's constructor was entered
    running = threading.Event()  # a controller's run() is waiting to finish

    def __init__(self, **kwargs) -> None:
        _StandInController.building.set()
        if kwargs.get("built_when"):
            kwargs["built_when"].wait(60)
        self.kwargs = kwargs
        self.loop_thread = threading.current_thread()
        self.finish = asyncio.Event()
        self.aborted = False
        _StandInController.instances.append(self)

    async def run(self) -> None:
        if self.kwargs.get("fail"):
            raise ValueError(self.kwargs["fail"])
        if self.kwargs.get("finish_at_once"):
            return
        _StandInController.running.set()
        await self.finish.wait()

    async def abort(self) -> None:
        self.aborted = True
        self.finish.set()

    def get_result(self) -> str:
        return f"result of {self.kwargs['name']}"


@pytest.fixture
def stand_in(monkeypatch):
    _StandInController.instances.clear()
    _StandInController.building.clear()
    _StandInController.running.clear()
    monkeypatch.setattr(controller_in_driver, "_DriverController", _StandInController)
    return _StandInController.instances


def test_the_driver_gets_the_controllers_result_from_a_thread_of_its_own(stand_in):
    assert run_controller_in_driver({"name": "a", "finish_at_once": True}) == "result of a"
    (controller,) = stand_in
    assert controller.kwargs["name"] == "a"
    assert controller.loop_thread is not threading.current_thread()


def test_a_controller_error_is_raised_in_the_driver(stand_in):
    with pytest.raises(ValueError, match="broke"):
        run_controller_in_driver({"name": "b", "fail": "broke"})


@contextmanager
def _interrupted_when(event: threading.Event, then=None):
    """A second Ctrl-C (driver.signals raises KeyboardInterrupt in the waiting thread), sent
    once ``event`` is set, then ``then()``: on events, not on a timer, so that a starved
    machine cannot send it before the moment a test is about."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    def send() -> None:
        event.wait(60)  # sent either way: a test whose moment never came fails, not hangs
        os.kill(os.getpid(), signal.SIGUSR1)
        if then is not None:
            time.sleep(0.2)  # the driver takes the interruption before the controller is up
            then()

    previous = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=send, daemon=True)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        sender.join(60)
        signal.signal(signal.SIGUSR1, previous)


def test_an_interrupted_driver_aborts_the_run_then_goes_on_up(stand_in):
    """Stops the workers through Ray's abort, as Ray's own handler would, before the driver
    ends."""
    with _interrupted_when(_StandInController.running):
        run_controller_in_driver({"name": "c"})
    (controller,) = stand_in
    assert controller.aborted


def test_a_driver_interrupted_while_the_controller_is_built_aborts_it_once_built(stand_in):
    built_when = threading.Event()
    with _interrupted_when(_StandInController.building, then=built_when.set):
        run_controller_in_driver({"name": "e", "built_when": built_when})
    (controller,) = stand_in
    assert controller.aborted


def test_a_driver_interrupted_before_the_controller_thread_started_has_nothing_to_abort(stand_in):
    runner = controller_in_driver._ControllerThread({"name": "f"})
    runner.abort()  # returns at once: no thread, so no controller, was started
    assert stand_in == []


def test_a_driver_already_running_an_event_loop_can_wait_for_it(stand_in):
    # A notebook's kernel runs its cells inside an event loop: asyncio.run() there fails.
    async def cell() -> str:
        return run_controller_in_driver({"name": "d", "finish_at_once": True})

    assert asyncio.run(cell()) == "result of d"


def test_a_worker_asking_for_the_controller_is_told_why_in_one_sentence():
    handle = pickle.loads(pickle.dumps(_NoControllerActor()))  # as the workers get it
    with pytest.raises(RuntimeError, match="get_all_reported_checkpoints") as raised:
        handle.get_all_reported_checkpoints.remote(0)
    assert "\n" not in str(raised.value)


def _keywords(function) -> set[str]:
    return set(re.findall(r"\b(\w+)=", inspect.getsource(function)))


def test_the_ray_method_raytrain_restates_is_rays_but_for_the_controller_handle():
    """``_init_train_context_on_workers`` is Ray's method with one argument changed; this
    pins it to the installed Ray's (CI runs the oldest and the newest of the range)."""
    ours = controller_in_driver._WorkerGroupOfADriverController._init_train_context_on_workers
    rays = ray_internals.WorkerGroup._init_train_context_on_workers
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(rays).parameters)
    # The same keyword arguments to the workers, and only the controller handle differs.
    assert _keywords(ours) == _keywords(rays)
    assert "controller_actor=_NoControllerActor()" in inspect.getsource(ours)
    assert "controller_actor=ray.get_runtime_context().current_actor" in inspect.getsource(rays)
    assert "self._decorate_worker_log_file_paths(workers)" in inspect.getsource(rays)
    # Ray's abort ends with exit_actor(), which raises this in a driver (suppressed there).
    with pytest.raises(TypeError):
        ray.actor.exit_actor()
