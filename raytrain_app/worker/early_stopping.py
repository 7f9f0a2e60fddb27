"""Early stopping on ``train.monitor``: a pure function of the run's epoch history.

Every row of the history holds global metrics (the same on every rank), and the history
is checkpointed and resumed with the run, so the decision is the same on every rank, and
a resume, even one after the run already stopped, reaches the same decision without
counters of its own: the best value and the epochs since it are read off the history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raytrain_app.config import TrainConfig
from raytrain_app.config.recipe_sections import EarlyStoppingConfig


@dataclass(frozen=True)
class EarlyStopping:
    """``train.early_stopping`` on ``train.monitor`` / ``train.mode``; off when ``rule`` is None."""

    rule: EarlyStoppingConfig | None
    monitor: str
    mode: str

    @classmethod
    def of(cls, train: TrainConfig) -> EarlyStopping:
        return cls(train.early_stopping, train.monitor, train.mode)

    def _better(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        delta = self.rule.min_delta if self.rule else 0.0
        return value < best - delta if self.mode == "min" else value > best + delta

    def _walk(self, history: list[dict[str, Any]]) -> tuple[int | None, bool]:
        """(the epoch the run stops after, or None; whether the last epoch improved)."""
        if self.rule is None:
            return None, False
        best, since, improved = None, 0, False
        for epoch, row in enumerate(history, start=1):
            value = row.get(self.monitor)
            improved = value is not None and math.isfinite(value) and self._better(value, best)
            best, since = (value, 0) if improved else (best, since + 1)
            if since >= self.rule.patience and epoch >= self.rule.min_epochs:
                return epoch, improved
        return None, improved

    def stopped_at(self, history: list[dict[str, Any]]) -> int | None:
        """The epoch (counted from 1) after which the run stopped early, or None."""
        return self._walk(history)[0]

    def checkpoint_due(self, history: list[dict[str, Any]]) -> bool:
        """Checkpoint the newest epoch when it is the best so far (so the best epoch's
        checkpoint exists for the ranking to keep) or when the run stops after it."""
        stopped, improved = self._walk(history)
        return improved or stopped == len(history)
