"""Whether the driver asked the run to checkpoint and stop (a stop signal reached it).

Rank 0 asks the driver's run-control actor between steps, without waiting for the
answer on the training path; the answer reaches the other ranks through the per-step
agreement (``step_agreement``), so every rank stops at the same step. In Ray Train's
local mode the driver is this process, and its flag is read directly.
"""

from __future__ import annotations

import threading
import time
from typing import Any

# How often rank 0 asks: one small actor call, answered while training goes on.
POLL_INTERVAL_S = 0.5


class StopRequest:
    """Rank 0's view of the driver's stop request; other ranks never ask."""

    def __init__(self, control: Any, rank_zero: bool) -> None:
        # The RunControl actor, the driver's flag in local mode, or None.
        self._control = control if rank_zero else None
        self._pending: Any = None  # the unanswered question
        self._last_poll = 0.0

    def requested(self) -> bool:
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
            return bool(answer)
        now = time.monotonic()
        if now - self._last_poll >= POLL_INTERVAL_S:
            self._last_poll = now
            self._pending = self._control.stop_requested.remote()
        return False
