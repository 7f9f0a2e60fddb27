"""What a worker tells about its steps while it trains: rank 0's step scalars to the
trackers and progress to the driver's bar, the goodput account (``goodput``) that rank 0
sends the driver's run control, and every worker's live Ray metrics (``live_metrics``).

All of it is cheap and throttled: nothing here waits for the driver or the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from raytrain_app.config import RaytrainConfig
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.tracking.base import Tracker
from raytrain_app.worker.goodput import Goodput, spans_for
from raytrain_app.worker.live_metrics import LiveMetrics
from raytrain_app.worker.rank_zero import is_rank_zero

# How often rank 0 updates the driver (progress bar, goodput account) and every worker its
# live metrics; cheap, fire-and-forget.
INTERVAL_S = 0.5


class StepTelemetry:
    """One worker's step-level reporting, around its ``Goodput`` account."""

    def __init__(
        self,
        task: Any,
        plan: TrainingPlan,
        steps_per_epoch: int,
        epochs: int,
        device: torch.device,
        live: LiveMetrics,
        driver: Any = None,
    ) -> None:
        """``plan``: the worker's own (for its world size, after the memory probe);
        ``driver``: the driver's RunControl actor where this is rank 0, else None."""
        self.task, self.world_size = task, plan.world_size
        self.samples_per_step = plan.effective_batch_size
        self.steps_per_epoch, self.epochs = steps_per_epoch, epochs
        self.goodput = Goodput(spans_for(device))
        self.live = live
        self._driver = driver
        self._bar = bool(task.show_progress and task.control and is_rank_zero())
        self._last = time.perf_counter()
        self._window = (self._last, 0.0, 0)  # an interval's start: then, data wait, steps

    @classmethod
    def for_worker(cls, task: Any, cfg: RaytrainConfig, parts: Any, rank: int) -> StepTelemetry:
        """The telemetry of the worker built as ``parts`` (``worker_setup.WorkerParts``)."""
        run = task.trial.trial_id if task.trial else cfg.experiment.name
        # MFU where the model's FLOPs and the device's peak are known (worker.throughput).
        live = LiveMetrics.on_ray(run, rank, achieved=parts.stepper.throughput.achieved)
        steps = parts.loaders.steps_per_epoch
        driver = task.control if is_rank_zero() and _is_actor(task.control) else None
        return cls(task, parts.plan, steps, cfg.train.epochs, parts.device, live, driver)

    def begin(self, step: int) -> None:
        """The first step starts: the driver learns when, and from which step."""
        self.goodput.begin(step)
        self._last = time.perf_counter()
        self._window = (self._last, 0.0, self.goodput.steps)
        self._send_account()

    def after_step(
        self,
        state: Any,
        epoch: int,
        loss: torch.Tensor,
        elapsed: float,
        tracker: Tracker,
        lr: Callable[[], float],
    ) -> None:
        """The step that brought ``state`` (the loop's ``LoopState``) to its step is done:
        its compute ends; step scalars where due; every ``INTERVAL_S`` the live metrics,
        the driver's bar and the account.

        ``elapsed``: the epoch's training time so far, the part before a mid-epoch
        checkpoint (or before a resume) included, as the step count is.
        """
        step, step_in_epoch = state.step, state.step_in_epoch
        self.goodput.step_done(step)
        if tracker.due(step):
            tracker.log_step(step, {"loss": float(loss.detach()), "lr": lr()})
        now = time.perf_counter()
        if now - self._last < INTERVAL_S and step_in_epoch < self.steps_per_epoch:
            return
        self._last = now
        self._live_interval(now)
        self._send_account()
        if self._bar:
            self.task.control.update.remote(
                epoch=epoch + 1,
                epochs=self.epochs,
                step=step_in_epoch,
                steps=self.steps_per_epoch,
                loss=float(loss.detach()),
                samples_per_s=step_in_epoch * self.samples_per_step / max(elapsed, 1e-9),
                workers=self.world_size,
            )

    def _live_interval(self, now: float) -> None:
        """This worker's numbers since the previous interval, as Ray metrics."""
        start, waited, steps = self._window
        data_wait, done = self.goodput.parts["data_wait_s"], self.goodput.steps
        self._window = (now, data_wait, done)
        samples = (done - steps) * self.samples_per_step / self.world_size
        self.live.interval(done - steps, now - start, data_wait - waited, samples)

    @contextlib.contextmanager
    def reporting(self, due: bool) -> Iterator[None]:
        """Around a report: with a checkpoint (``due``), the time it blocks training is
        counted, and the driver learns the step first (a failure while saving loses the
        steps since the checkpoint it resumes from)."""
        if not due:
            yield
            return
        self._send_account()
        start = time.perf_counter()
        try:
            yield
        finally:
            blocked = time.perf_counter() - start
            self.goodput.add_checkpoint_blocked(blocked)
            self.live.checkpoint_blocked(blocked)

    def _send_account(self) -> None:
        if self._driver is not None:
            self._driver.account.remote(self.goodput.record())


def _is_actor(control: Any) -> bool:
    """Whether ``control`` is the driver's RunControl actor (local mode's is a flag)."""
    if control is None:
        return False
    from ray.actor import ActorHandle

    return isinstance(control, ActorHandle)
