"""The interface every tracking backend implements, and the scalars of an epoch row.

Every backend uses the global optimizer step as its x-axis: step scalars (rank 0's batch
loss, the lr) every ``tracking.log_every_steps`` steps, and the epoch row at each epoch's
last step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Tracker:
    """The interface every backend implements; this base does nothing (ranks other than 0)."""

    log_every_steps = 0

    def due(self, step: int) -> bool:
        """Whether step scalars of optimizer ``step`` should be logged (cheap check first)."""
        return bool(self.log_every_steps) and step % self.log_every_steps == 0

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        """Per-step scalars (``loss``, ``lr``) at optimizer ``step``."""

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        """One epoch's row (the metrics.csv columns) at the epoch's last optimizer ``step``."""

    def close(self, failed: bool = False) -> None:
        """Flush and end the run; ``failed`` marks it as such where the backend can."""


def epoch_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in row.items()
        if key not in ("epoch", "step") and isinstance(value, int | float)
    }
