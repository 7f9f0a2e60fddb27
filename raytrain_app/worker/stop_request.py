"""Whether the driver asked the run to checkpoint and stop (a stop signal reached it), or to
stop at once without writing anything more (its run lost the lease of the run directory).

Rank 0 asks the driver's run-control actor between steps, without waiting for the
answer on the training path; the answer reaches the other ranks through the per-step
agreement (``step_agreement``), so every rank stops at the same step. In Ray Train's
local mode the driver is this process, and its flag is read directly.

A lost lease is not agreed on: rank 0 raises at once, before the next step could report a
checkpoint, and the other ranks end with the failed worker group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from raytrain_app.errors import RunFailedError

# How often rank 0 asks: one small actor call, answered while training goes on.
POLL_INTERVAL_S = 0.5

# Set by the driver for the time it holds the run directory's lease (driver.run_lease): a
# function that says why the run must stop writing at once, or None while it may write. In
# local mode the worker runs in the driver's own thread and reads it here; on Ray the
# driver's run control passes the answer on to the workers (driver.run_control).
lease_lost: ContextVar[Callable[[], str | None] | None] = ContextVar(
    "raytrain_lease_lost", default=None
)


class StopRequest:
    """Rank 0's view of the driver's stop request; other ranks never ask."""

    def __init__(self, control: Any, rank_zero: bool) -> None:
        # The RunControl actor, the driver's flag in local mode, or None.
        self._control = control if rank_zero else None
        self._lost = lease_lost.get() if rank_zero else None
        self._pending: Any = None  # the unanswered question
        self._last_poll = 0.0
        # The first question, asked now and answered while the worker builds its model
        # (waited for on the way it took 0.2 s of the first step): ``confirm_lease``.
        self._first: Any = None
        if _is_actor(self._control):
            self._first = self._pending = self._control.requests.remote()

    def confirm_lease(self) -> None:
        """Wait for the first answer, before rank 0 first writes to the run directory: a
        worker group that Ray Train restarts after the lease was lost must fail here,
        before it rewrites metrics.csv or trackers.

        Raises:
            RunFailedError: the driver lost the run directory's lease.
        """
        if self._first is None:
            return
        import ray

        first, self._first = self._first, None
        _raise_if_lost(ray.get(first))  # its stop, if asked, is ``requested``'s next answer

    def requested(self) -> bool:
        """Whether to checkpoint at the next step and stop.

        Raises:
            RunFailedError: the driver lost the run directory's lease: stop writing now.
        """
        if self._lost is not None:
            why = self._lost()
            if why:
                raise RunFailedError(why)
        if self._control is None:
            return False
        if isinstance(self._control, threading.Event):  # local mode: the driver's own flag
            return self._control.is_set()
        import ray

        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if not ready:
                return False
            answer, self._pending = ray.get(self._pending), None
            return _raise_if_lost(answer)
        now = time.monotonic()
        if now - self._last_poll >= POLL_INTERVAL_S:
            self._last_poll = now
            self._pending = self._control.requests.remote()
        return False


def _raise_if_lost(answer: tuple[bool, str | None]) -> bool:
    """The run control's answer: whether a stop was asked; raises if the lease was lost."""
    stop, lost = answer
    if lost:
        raise RunFailedError(lost)
    return bool(stop)


def _is_actor(control: Any) -> bool:
    if control is None or isinstance(control, threading.Event):
        return False
    from ray.actor import ActorHandle

    return isinstance(control, ActorHandle)
