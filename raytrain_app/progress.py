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
        bar = None
        epoch = None
        try:
            while not self._stop.wait(_POLL_INTERVAL_S):
                snap = ray.get(self.tracker.snapshot.remote())
                if not snap:
                    continue
                if snap["epoch"] != epoch:
                    if bar is not None:
                        bar.close()
                    epoch = snap["epoch"]
                    bar = tqdm(
                        total=snap["steps"],
                        desc=f"epoch {epoch}/{snap['epochs']}",
                        unit="step",
                        leave=True,
                        dynamic_ncols=True,
                    )
                bar.update(snap["step"] - bar.n)
                bar.set_postfix(
                    loss=f"{snap['loss']:.4f}",
                    samples_s=f"{snap['samples_per_s']:.0f}",
                    refresh=False,
                )
                bar.refresh()
        except Exception:
            pass
        finally:
            if bar is not None:
                bar.close()
