"""The memory of a process and of every process it started, from /proc, sampled while
something runs: the proportional set size (PSS), so pages shared between processes (Ray's
object store, shared libraries) count once across the tree. Ray's own accounting does not
see what its workers hold (ray#65544).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from raytrain_app.testing.processes import descendants


def pss_bytes(pid: int) -> int:
    """The process's PSS; 0 once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:  # it exited while we looked
        pass
    return 0


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()[:60]
    except OSError:
        return "?"


def tree_pss(root: int) -> dict[int, int]:
    """The PSS of ``root`` and of every process it started, by PID."""
    return {pid: pss_bytes(pid) for pid in {root, *descendants(root)}}


class TreePeak(threading.Thread):
    """Samples the PSS of ``root``'s tree until stopped: its peak, and the processes over
    20 MiB at the peak as (MiB, name). ``observe`` sees every sample, for subclasses."""

    def __init__(self, root: int, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.root, self.interval_s = root, interval_s
        self.tree_peak = 0
        self.tree_at_peak: list[tuple[int, str]] = []
        self._stop_event = threading.Event()

    def observe(self, sizes: dict[int, int]) -> None:
        """Called with each sample (PID -> PSS)."""

    def run(self) -> None:
        while not self._stop_event.is_set():
            sizes = tree_pss(self.root)
            self.observe(sizes)
            if sum(sizes.values()) > self.tree_peak:
                self.tree_peak = sum(sizes.values())
                self.tree_at_peak = sorted(
                    (
                        (size >> 20, process_name(pid))
                        for pid, size in sizes.items()
                        if size > 20 << 20
                    ),
                    reverse=True,
                )
            time.sleep(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def __enter__(self) -> TreePeak:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
