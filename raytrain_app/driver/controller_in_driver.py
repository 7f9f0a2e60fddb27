"""Ray Train's controller run in the driver process instead of as an actor.

Ray Train runs its controller (``TrainController``: it starts the worker group, polls it,
restarts it after a failure, keeps the checkpoint bookkeeping) as an actor on the driver's
node: one more process, which starts Python, imports Ray Train and torch, and only then
asks for the workers. On 2 cores that is 3-4 s on the way to the first step
(``benchmarks/first_step.py``). The driver has imported both already, and the actor gains
the run nothing: it is the driver's, so it ends with the driver (and on a Ray the driver
started, so does the whole Ray). So the same controller runs on an event loop in a thread
of the driver, and the caller waits for it. Only a Ray Client driver (``ray://``), which
runs off the cluster, keeps the actor (``driver.trainer``).

What differs from the actor, and why it does not matter to raytrain:

- The workers get no handle to the controller. Ray Train uses it only for
  ``ray.train.get_all_reported_checkpoints()``, which raytrain's loop does not call; a
  worker that does gets one sentence saying why (``_NoControllerActor``).
- Ray Train's controller log lines go to this process's ``ray.train`` logger (its files
  under the session's ``logs/train/``, and the console at the run's log level), where the
  actor's reached the console through Ray's log monitor.
- No placement group can outlive the controller: Ray removes a job's groups when its
  driver ends. So Ray's placement-group cleaner, which removes them when the controller
  actor dies and would watch an actor id the driver does not have, is left out
  (``callbacks_for_the_driver``). Ray Train's state tracking
  (``RAY_TRAIN_ENABLE_STATE_TRACKING``) records that id too: a run with it keeps the
  actor, and the cleaner with it (``runs_here``).

These are Ray Train V2 internals (``ray_internals``); on a Ray without them the controller
is Ray's actor, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

import ray

from raytrain_app.driver import ray_internals as internals

logger = logging.getLogger(__name__)

# How long an interrupted driver gives the controller to stop the workers (Ray's abort).
_ABORT_TIMEOUT_S = 30.0


class _NoControllerActor:
    """What the workers get for the controller's actor handle: there is none."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # pickling and copying look these up
            raise AttributeError(name)
        raise RuntimeError(
            "raytrain runs this run's Ray Train controller in its driver, not as an actor, so "
            "ray.train.get_all_reported_checkpoints() is not available to the workers; read "
            "the run directory's checkpoints instead."
        )


def controller_can_run_here() -> bool:
    """Whether this Ray has what running its controller in the driver takes."""
    return internals.TrainController is not None and internals.WorkerGroup is not None


def runs_here(callbacks: list) -> bool:
    """Whether the controller of a run with these controller ``callbacks`` can run in the
    driver: this Ray allows it, and no callback needs the controller's actor id."""
    tracking = internals.StateManagerCallback
    needs_the_id = tracking is not None and any(isinstance(cb, tracking) for cb in callbacks)
    return controller_can_run_here() and not needs_the_id


def callbacks_for_the_driver(callbacks: list) -> list:
    """``callbacks`` less those that only serve a controller actor: the placement-group
    cleaner, which removes the workers' group should that actor die before its driver."""
    cleaner = internals.PlacementGroupCleanerCallback
    return [cb for cb in callbacks if cleaner is None or not isinstance(cb, cleaner)]


# Ray's classes where this Ray has them; a stand-in base elsewhere keeps the module
# importable (the classes are then never used: see runs_here).
_WorkerGroupBase: type = internals.WorkerGroup or object
_ControllerBase: type = internals.TrainController or object


class _WorkerGroupOfADriverController(_WorkerGroupBase):
    """Ray Train's worker group, but for the controller handle it gives the workers."""

    # Ray's method (the same in Ray 2.58 to 2.60) but for controller_actor: Ray's is the
    # current actor's handle, which a driver does not have.
    def _init_train_context_on_workers(
        self, workers: list, sync_actor: Any, train_context_args: dict[str, list[Any]]
    ) -> None:
        ray.get(
            [
                worker.actor.init_train_context.remote(
                    train_run_context=self._train_run_context,
                    distributed_context=worker.distributed_context,
                    synchronization_actor=sync_actor,
                    storage_context=self._storage_context,
                    worker_callbacks=self._worker_callbacks_to_propagate,
                    controller_actor=_NoControllerActor(),
                    **{arg: values[i] for arg, values in train_context_args.items()},
                )
                for i, worker in enumerate(workers)
            ]
        )
        self._decorate_worker_log_file_paths(workers)


class _DriverController(_ControllerBase):
    """Ray Train's controller, run by a driver rather than as an actor."""

    worker_group_cls = _WorkerGroupOfADriverController

    async def abort(self) -> None:
        # Ray's abort ends with exit_actor(), and a driver has no actor to exit: it raises
        # TypeError once the workers are stopped and the state is Aborted.
        with contextlib.suppress(TypeError):
            await super().abort()


class _ControllerThread:
    """The controller's event loop in a thread of its own: the caller's thread stays free
    for signals (``driver.signals``), and a caller that runs an event loop already (a
    notebook's kernel) can wait too."""

    def __init__(self, controller_kwargs: dict[str, Any]) -> None:
        self._kwargs = controller_kwargs
        self._started = threading.Event()  # the controller is built (or failed to be)
        # Its own flag: Thread.is_alive() is wrong after an exception interrupted join().
        self._finished = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._controller: Any = None
        self.result: Any = None
        self.error: BaseException | None = None
        # A daemon: an interrupted driver exits without waiting for it.
        self._thread = threading.Thread(
            target=self._run, name="raytrain-train-controller", daemon=True
        )
        self._launched = False

    def start(self) -> None:
        # Set first: an interruption inside Thread.start() may come once the thread exists.
        self._launched = True
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # raised again in the caller's thread
            self.error = exc
        finally:
            self._started.set()
            self._finished.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._controller = _DriverController(**self._kwargs)
        self._started.set()
        await self._controller.run()
        self.result = self._controller.get_result()

    def wait(self) -> None:
        """Until the run ends; in short waits, so that a signal handler's exception
        reaches the caller's thread."""
        while not self._finished.wait(0.5):
            pass

    def abort(self) -> None:
        """Ray's abort of the run (the workers stopped), from another thread; a run that
        ended meanwhile, or whose thread never started, has nothing to abort."""
        if not self._launched:
            return
        # Bounded: an interruption just before the thread was created leaves none to wait for.
        self._started.wait(_ABORT_TIMEOUT_S)
        if self._finished.is_set() or self._loop is None:
            return
        with contextlib.suppress(Exception):  # a loop closed meanwhile, Ray's own errors
            future = asyncio.run_coroutine_threadsafe(self._controller.abort(), self._loop)
            future.result(timeout=_ABORT_TIMEOUT_S)


def run_controller_in_driver(controller_kwargs: dict[str, Any]) -> Any:
    """Run Ray Train's controller in this process until the run ends; its ``Result``.

    ``controller_kwargs`` are what ``TorchTrainer.fit`` gives the controller actor. An
    interruption of the waiting thread (a second Ctrl-C) aborts the run as Ray's Ctrl-C
    handler does, then goes on up.
    """
    runner = _ControllerThread(controller_kwargs)
    try:
        runner.start()
        runner.wait()
    except BaseException:
        logger.debug("the driver was interrupted: aborting the run's workers")
        runner.abort()
        raise
    if runner.error is not None:
        raise runner.error
    return runner.result
