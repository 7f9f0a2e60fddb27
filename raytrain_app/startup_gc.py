"""Python's cyclic garbage collector held off while a process starts a run.

A run's start imports torch, Ray Train and ``torch._dynamo`` (DDP's constructor and every
optimizer's import it) into a heap that Ray already filled. CPython collects the oldest
generation every so many allocations and walks every live object each time, so those
imports pay for collections that walk a growing heap: about 1 s of CPU per training worker
and 0.6 s in the driver, on the way to the first step (benchmarks/README.md, "First step").
Start-up makes few reference cycles, and CPython frees everything else by reference
counting, collector or not; the collector is back on once the first step is done.

Only a collector this module turned off is turned back on: a process that turned it off
itself keeps it off. Standard library only: a worker imports this before torch.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# A process that never reaches its first step (a controller actor that unpickled the
# workers' config, a run that failed in set-up) gets its collector back after this long.
_LONGEST_PAUSE_S = 300.0

_lock = threading.Lock()
_timer: threading.Timer | None = None


def pause() -> None:
    """Turn the collector off until ``resume`` (at most ``_LONGEST_PAUSE_S``), if it is on."""
    global _timer
    with _lock:
        if _timer is not None or not gc.isenabled():
            return
        gc.disable()
        _timer = threading.Timer(_LONGEST_PAUSE_S, resume)
        _timer.daemon = True
        _timer.start()


def resume() -> None:
    """Turn the collector back on if ``pause`` turned it off; otherwise nothing."""
    global _timer
    if _timer is None:  # every step after the first: no lock on the step's path
        return
    with _lock:
        if _timer is None:
            return
        _timer.cancel()
        _timer = None
        gc.enable()


@contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block (unless already paused: then ``resume`` ends it)."""
    pausing = _timer is None
    pause()
    try:
        yield
    finally:
        if pausing:
            resume()


class PauseOnArrival:
    """Put first into what a worker unpickles for its run (Ray Train's train-loop config):
    unpickling it pauses that process's collector before the rest of the config brings in
    torch. The worker's loop resumes it after its first step."""

    def __reduce__(self) -> tuple:
        return (_arrive, ())

    def __copy__(self) -> PauseOnArrival:  # a copy in the same process pauses nothing
        return self

    def __deepcopy__(self, memo: dict) -> PauseOnArrival:
        return self


def _arrive() -> PauseOnArrival:
    pause()
    return PauseOnArrival()


def _collector_back_in_forked_child() -> None:
    """A process forked during the pause (a DataLoader's workers, forked in set-up) has the
    collector off and no timer thread, and never reaches the loop's first step: it gets
    the collector back at once. Single-threaded there: a fresh lock, not the parent's."""
    global _lock, _timer
    _lock = threading.Lock()
    if _timer is not None:
        _timer = None
        gc.enable()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_collector_back_in_forked_child)
