"""Which metrics a model reports, learnt as a worker runs, and the checks that need them.

The names of the means (loss and the step's metrics) are known after the first step; those
that ``metrics_from_counts`` makes of summed counts only after the first epoch. Once each
is known, ``train.monitor`` must be among them: a typo fails in the first epoch, not when
the first checkpoint is ranked.
"""

from __future__ import annotations

from typing import Any

from raytrain_app.checkpoint.ranking import check_monitor
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import ModelSpec, check_counts_hook, counted_metrics
from raytrain_app.worker.global_metrics import Counts


class MetricNames:
    """One worker's view of the model's metric names."""

    def __init__(self, monitor: str) -> None:
        self.monitor = monitor
        self._means: list[str] | None = None  # known after the first step
        self._counted: set[str] = set()  # of metrics_from_counts, after an epoch
        self._counted_checked = False

    @property
    def means(self) -> list[str]:
        """The names of the means the steps report ([] before the first step)."""
        return self._means or []

    def note_step(self, spec: ModelSpec, outcome: Any) -> None:
        """After a step (a ``StepOutcome``): the first one tells which metrics there are."""
        if self._means is None:
            for counts in outcome.micro_counts:
                check_counts_hook(spec, counts)
            if spec.metrics_from_counts is None:  # else known after the first epoch
                check_monitor(self.monitor, outcome.metric_names)
        self._means = outcome.metric_names

    def check_counted(self, spec: ModelSpec) -> None:
        """Once, after this process's first epoch, when the metrics made of counts are
        known: that there are some, and the monitor among them or the means."""
        if self._counted_checked or spec.metrics_from_counts is None:
            return
        self._counted_checked = True
        if not self._counted:
            raise BadInputError(
                "the model factory's ModelSpec has metrics_from_counts but no step returned "
                "StepOutput.counts; return the counts it needs from the step function, or "
                "leave metrics_from_counts unset"
            )
        check_monitor(self.monitor, [*self.means, *sorted(self._counted)])

    def counted(
        self, spec: ModelSpec, prefix: str, counts: Counts, world_size: int
    ) -> dict[str, float]:
        """The metrics ``metrics_from_counts`` makes of the counts summed over all workers
        (the same on every rank); none without the hook or without counts."""
        if spec.metrics_from_counts is None:
            return {}
        totals = counts.global_totals(world_size)
        if not totals:
            return {}
        values = counted_metrics(spec, totals, self.means)
        self._counted.update(values)
        return {f"{prefix}{name}": value for name, value in values.items()}
