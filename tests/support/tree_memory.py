"""The memory of a process and of every process it started, from /proc, sampled while
something runs: the proportional set size (PSS), so pages shared between processes (Ray's
object store, shared libraries) count once across the tree. Ray's own accounting does not
see what its workers hold (ray#65544).

A file's pages (libtorch, Python's modules) are shared with every process on the machine
that maps the same file, the other test tier's Ray workers too: the tree's share of them
grows when those exit (five such processes exiting during a pass added 65 MiB to the
tree). ``held_bytes`` leaves them out, for bounds on the memory a computation holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from raytrain_app.testing.processes import descendants


def _rollup_bytes(pid: int, fields: tuple[str, ...]) -> int:
    """The sum of ``fields`` of the process's smaps_rollup; 0 once it has exited."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:  # it exited while we looked
        return 0
    return sum(int(line.split()[1]) * 1024 for line in lines if line.split(":")[0] in fields)


def pss_bytes(pid: int) -> int:
    """The process's PSS; 0 once it has exited."""
    return _rollup_bytes(pid, ("Pss",))


def held_bytes(pid: int) -> int:
    """The PSS of what the process holds that no file backs: its anonymous memory (heap,
    Arrow's buffers) and shared memory (Ray's object store); 0 once it has exited."""
    return _rollup_bytes(pid, ("Pss_Anon", "Pss_Shmem"))


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()[:60]
    except OSError:
        return "?"


def tree_pss(root: int, measure: Callable[[int], int] = pss_bytes) -> dict[int, int]:
    """The PSS (or ``measure``) of ``root`` and of every process it started, by PID."""
    return {pid: measure(pid) for pid in {root, *descendants(root)}}


class TreePeak(threading.Thread):
    """Samples the PSS (or ``measure``) of ``root``'s tree until stopped: its peak, and the
    processes over 20 MiB at the peak as (MiB, name). ``observe`` sees every sample, for
    subclasses."""

    def __init__(
        self,
        root: int,
        interval_s: float = 0.1,
        measure: Callable[[int], int] = pss_bytes,
    ) -> None:
        super().__init__(daemon=True)
        self.root, self.interval_s, self.measure = root, interval_s, measure
        self.tree_peak = 0
        self.tree_at_peak: list[tuple[int, str]] = []
        self._stop_event = threading.Event()

    def observe(self, sizes: dict[int, int]) -> None:
        """Called with each sample (PID -> PSS)."""

    def run(self) -> None:
        while not self._stop_event.is_set():
            sizes = tree_pss(self.root, self.measure)
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
