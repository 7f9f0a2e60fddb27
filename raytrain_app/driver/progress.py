"""Live progress on the driver: rank 0 pushes, the driver draws a bar.

Rank 0 sends fire-and-forget updates to a zero-CPU actor; a driver thread polls it and
updates a tqdm bar (``tqdm.auto`` renders as a widget in notebooks). Nothing on the
training hot path waits for the driver.
"""

from __future__ import annotations

import threading
from typing import Any

import ray
from tqdm.auto import tqdm

_POLL_INTERVAL_S = 0.5


@ray.remote(num_cpus=0)
class ProgressTracker:
    """Holds the latest progress snapshot pushed by rank 0."""

    def __init__(self) -> None:
        self._latest: dict[str, Any] = {}

    def update(self, **fields: Any) -> None:
        self._latest = fields

    def snapshot(self) -> dict[str, Any]:
        return self._latest


class DriverProgress:
    """Context manager: a tracker actor plus a bar refreshed from it in the background."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tracker = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DriverProgress:
        if self.enabled:
            self.tracker = ProgressTracker.remote()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self.tracker is not None:
            ray.kill(self.tracker)

    def _poll(self) -> None:
        bars = EpochBars()
        try:
            while not self._stop.wait(_POLL_INTERVAL_S):
                snap = ray.get(self.tracker.snapshot.remote())
                if snap:
                    bars.show(snap)
        except Exception:
            pass
        finally:
            bars.close()


class EpochBars:
    """One tqdm bar per epoch, drawn from rank 0's snapshots."""

    def __init__(self, **tqdm_kwargs: Any) -> None:
        self._tqdm_kwargs = {"leave": True, "dynamic_ncols": True, **tqdm_kwargs}
        self._bar: tqdm | None = None
        self._epoch: int | None = None

    def show(self, snap: dict[str, Any]) -> None:
        if snap["epoch"] != self._epoch:
            self.close()
            self._epoch = snap["epoch"]
            # The first snapshot of an epoch arrives some steps in: those steps are where
            # the bar starts, not progress made in no time (a rate of 500,000 steps/s).
            self._bar = tqdm(
                total=snap["steps"],
                initial=snap["step"],
                desc=f"epoch {self._epoch}/{snap['epochs']}",
                unit="step",
                **self._tqdm_kwargs,
            )
        self._bar.update(snap["step"] - self._bar.n)
        self._bar.set_postfix(
            loss=f"{snap['loss']:.4f}", samples_s=f"{snap['samples_per_s']:.0f}", refresh=False
        )
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
