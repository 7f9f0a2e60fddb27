"""The driver's channel to a running training: progress in, a stop request out.

One zero-CPU actor per run. Rank 0 pushes fire-and-forget progress snapshots to it and
polls it for a stop request between steps; a driver thread draws the progress bar from
it and passes the driver's stop request (a signal) on, and the news that the run lost the
lease of its run directory (the workers then stop without writing another checkpoint).
It is a Ray actor, not a file, so it reaches workers on every node whatever storage the
run directory is on.
"""

from __future__ import annotations

import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_app.driver.progress import progress_for
from raytrain_app.worker.stop_request import lease_lost

_POLL_INTERVAL_S = 0.5


@ray.remote(num_cpus=0)
class RunControl:
    """Holds rank 0's latest progress snapshot and what the driver asked of the workers."""

    def __init__(self) -> None:
        self._latest: dict[str, Any] = {}
        self._stop = False
        self._lease_lost: str | None = None
        self._accounts: dict[str, dict[str, Any]] = {}  # per attempt (driver.goodput)

    def account(self, record: dict[str, Any]) -> None:
        """Rank 0's latest goodput account of its attempt (``worker.goodput``)."""
        self._accounts[record["attempt"]] = record

    def accounts(self) -> list[dict[str, Any]]:
        return list(self._accounts.values())

    def update(self, **fields: Any) -> None:
        self._latest = fields

    def snapshot(self) -> dict[str, Any]:
        return self._latest

    def request_stop(self) -> None:
        self._stop = True

    def lose_lease(self, why: str) -> None:
        self._lease_lost = why

    def requests(self) -> tuple[bool, str | None]:
        """Whether to checkpoint and stop; and why to stop writing at once, if so."""
        return self._stop, self._lease_lost


class DriverControl:
    """Context manager: the run's control actor and a driver thread that draws the bar
    (when ``progress``), sends the stop request once ``stop`` is set and tells the workers
    when the run directory's lease, held around this, was lost."""

    def __init__(self, progress: bool = True) -> None:
        self.progress = progress
        self.stop = threading.Event()  # set by the signal handlers (driver.signals)
        self.actor = None
        self._lease_lost = lease_lost.get()  # the lease this run holds (driver.run_lease)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        # Every attempt's latest goodput account, read when the run ends (driver.goodput).
        self.accounts: list[dict[str, Any]] = []

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
        try:
            self.accounts = ray.get(self.actor.accounts.remote(), timeout=_POLL_INTERVAL_S * 10)
        except Exception:  # the account is a report, never a reason to fail the run
            self.accounts = []
        ray.kill(self.actor)

    def _run(self) -> None:
        bars = progress_for() if self.progress else None
        sent = lost = False
        try:
            while not self._done.wait(_POLL_INTERVAL_S):
                if self.stop.is_set() and not sent:
                    self.actor.request_stop.remote()
                    sent = True
                why = self._lease_lost() if self._lease_lost and not lost else None
                if why:
                    self.actor.lose_lease.remote(why)
                    lost = True
                if bars is not None:
                    bars = self._draw(bars)
        except Exception:  # an actor gone with the run: nothing left to tell it
            pass
        finally:
            if bars is not None:
                bars.close()

    def _draw(self, bars: Any) -> Any:
        """Show the latest snapshot; the bars, or None once drawing failed: the bar is a
        convenience, never a reason to fail the run or to stop passing requests on."""
        try:
            snap = ray.get(self.actor.snapshot.remote())
            if snap:
                bars.show(snap)
            return bars
        except Exception:
            bars.close()
            return None
