"""The driver's channel to a running training: progress in, a stop request out.

One zero-CPU actor per run. Rank 0 pushes fire-and-forget progress snapshots to it and
polls it for a stop request between steps; a driver thread draws the progress bar from
it and passes the driver's stop request (a signal) on. It is a Ray actor, not a file, so
it reaches workers on every node whatever storage the run directory is on.
"""

from __future__ import annotations

import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_app.driver.progress import progress_for

_POLL_INTERVAL_S = 0.5


@ray.remote(num_cpus=0)
class RunControl:
    """Holds rank 0's latest progress snapshot and whether the driver asked to stop."""

    def __init__(self) -> None:
        self._latest: dict[str, Any] = {}
        self._stop = False

    def update(self, **fields: Any) -> None:
        self._latest = fields

    def snapshot(self) -> dict[str, Any]:
        return self._latest

    def request_stop(self) -> None:
        self._stop = True

    def stop_requested(self) -> bool:
        return self._stop


class DriverControl:
    """Context manager: the run's control actor and a driver thread that draws the bar
    (when ``progress``) and sends the stop request once ``stop`` is set."""

    def __init__(self, progress: bool = True) -> None:
        self.progress = progress
        self.stop = threading.Event()  # set by the signal handlers (driver.signals)
        self.actor = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DriverControl:
        # On the driver's own node: placed anywhere (it needs no CPU), it could land on a
        # node the run later loses, and every worker would then fail with it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.actor = RunControl.options(scheduling_strategy=here).remote()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread:
            self._thread.join(timeout=5)
        ray.kill(self.actor)

    def _run(self) -> None:
        bars = progress_for() if self.progress else None
        sent = False
        try:
            while not self._done.wait(_POLL_INTERVAL_S):
                if self.stop.is_set() and not sent:
                    self.actor.request_stop.remote()
                    sent = True
                if bars is not None:
                    snap = ray.get(self.actor.snapshot.remote())
                    if snap:
                        bars.show(snap)
        except Exception:  # the bar is a convenience: never fail the run over it
            pass
        finally:
            if bars is not None:
                bars.close()
