"""Whether the driver asked the run to checkpoint and stop (a stop signal reached it).

Rank 0 looks for the driver's request between steps; the answer reaches the other ranks
through the per-step agreement (``step_agreement``), so every rank stops at the same step.
"""

from __future__ import annotations

import time
from pathlib import Path

# How often rank 0 looks for the request: a file check, cheap but not free every step.
POLL_INTERVAL_S = 0.5


class StopRequest:
    """Rank 0's view of the driver's stop request; other ranks never see it directly."""

    def __init__(self, stop_file: str | None, rank_zero: bool) -> None:
        self._file = Path(stop_file) if stop_file and rank_zero else None
        self._last_poll = 0.0

    def requested(self) -> bool:
        if self._file is None:
            return False
        now = time.monotonic()
        if now - self._last_poll < POLL_INTERVAL_S:
            return False
        self._last_poll = now
        return self._file.exists()
