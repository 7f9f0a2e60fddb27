"""A worker's live numbers as Ray metrics: what Ray's Prometheus endpoint and dashboard
show per run and per worker while the run trains.

Every worker sets them from its own steps a few times a second (a metric's ``set`` is a
local call; Ray's core worker exports them to its node's metrics agent on its own
interval). Each carries the tags ``run`` (``experiment.name``, a sweep's trial id) and
``rank``. Ray's exporter prefixes ``ray_`` and gives a Counter the suffix ``_total``;
docs/operators/observability.md lists the names as Prometheus shows them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

STEP_TIME = "raytrain_step_time_seconds"
SAMPLES_PER_S = "raytrain_samples_per_second"
DATA_WAIT = "raytrain_data_wait_ratio"
CHECKPOINT_BLOCKED = "raytrain_checkpoint_blocked_seconds"
MFU = "raytrain_mfu_ratio"
TAG_KEYS = ("run", "rank")

_GAUGES = {
    STEP_TIME: "Mean optimizer step time over the last interval, data waits included (s)",
    SAMPLES_PER_S: "Samples this worker trained per second over the last interval",
    DATA_WAIT: "Share of the last interval this worker waited for its next batch",
    MFU: "Model FLOPs utilisation of this worker's device (only where its peak is known)",
}


class LiveMetrics:
    """One worker's Ray metrics; does nothing where ``metrics`` is None (no Ray here).

    ``achieved``: a rate of samples per second of this worker -> ``{"mfu": ...}`` where
    the model's FLOPs and the device's peak are known (``worker.throughput``); MFU is
    published only then.
    """

    def __init__(
        self,
        run: str,
        rank: int,
        metrics: Any = None,
        achieved: Callable[[float], dict[str, float]] | None = None,
    ) -> None:
        self.achieved = achieved
        self._gauges: dict[str, Any] = {}
        self._blocked: Any = None
        if metrics is None:
            return
        tags = {"run": run, "rank": str(rank)}
        for name, description in _GAUGES.items():
            gauge = metrics.Gauge(name, description=description, tag_keys=TAG_KEYS)
            self._gauges[name] = gauge.set_default_tags(tags)
        counter = metrics.Counter(
            CHECKPOINT_BLOCKED,
            description="Seconds checkpoints kept this worker from training",
            tag_keys=TAG_KEYS,
        )
        self._blocked = counter.set_default_tags(tags)

    @classmethod
    def on_ray(
        cls, run: str, rank: int, achieved: Callable[[float], dict[str, float]] | None = None
    ) -> LiveMetrics:
        """Ray metrics where this process is connected to Ray; none elsewhere (local mode,
        torchrun, the unit tests' in-process loops)."""
        import ray

        if not ray.is_initialized():
            return cls(run, rank, achieved=achieved)
        from ray.util import metrics

        return cls(run, rank, metrics, achieved)

    def interval(self, steps: int, seconds: float, data_wait_s: float, samples: int) -> None:
        """``steps`` optimizer steps of ``samples`` samples in ``seconds``, of which this
        worker waited ``data_wait_s`` for data."""
        if not self._gauges or steps <= 0 or seconds <= 0:
            return
        rate = samples / seconds
        self._gauges[STEP_TIME].set(seconds / steps)
        self._gauges[SAMPLES_PER_S].set(rate)
        self._gauges[DATA_WAIT].set(min(1.0, data_wait_s / seconds))
        mfu = (self.achieved(rate) if self.achieved else {}).get("mfu")
        if mfu is not None:
            self._gauges[MFU].set(mfu)

    def checkpoint_blocked(self, seconds: float) -> None:
        if self._blocked is not None and seconds > 0:
            self._blocked.inc(seconds)
