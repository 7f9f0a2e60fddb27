"""Where a worker's time goes: waiting for data, computing, blocked on a checkpoint,
validating, and the rest, from its first step on.

The loop marks the spans (``Goodput.timed`` around its batches, ``step_done`` after each
update, ``timing`` around validation, ``add_checkpoint_blocked`` for a checkpoint); the
driver adds what only it sees (start-up, restarts, lost work: ``driver.goodput``).

Compute is timed on the device's own clock: on a GPU the host queues kernels and runs
ahead, so host time around a step says when it was queued, not how long it ran. There a
pair of timing events brackets each compute span on the stream and is read later, once
the device has passed it (``EventSpans``): no host sync per step. On the CPU the host's
clock is the device's (``HostSpans``). Data waits, validation and checkpoints are host
time on both: the host does wait for them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

# The worker's parts, as summary.json's goodput names them; metrics.csv's columns of each
# epoch's seconds (GOODPUT_COLUMNS) prefix them with ``time_`` and add ``time_other_s``.
WORKER_PARTS = ("data_wait_s", "compute_s", "checkpoint_s", "validation_s")
# Pending event pairs read without waiting once this many are queued.
_RESOLVE_EVERY = 64


class Spans(Protocol):
    """Compute spans on the device's clock: opened when a batch is in hand, closed when
    the loop asks for the next one or the step ends."""

    def open(self) -> None: ...

    def close(self) -> None: ...

    def resolve(self, wait: bool) -> float:
        """The seconds of every span closed so far that can be read (all with ``wait``)."""
        ...


class HostSpans:
    """Spans on the host's clock: the device's own where the device is the CPU."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.total = 0.0
        self._opened: float | None = None

    def open(self) -> None:
        self._opened = self.clock()

    def close(self) -> None:
        if self._opened is not None:
            self.total += self.clock() - self._opened
            self._opened = None

    def resolve(self, wait: bool) -> float:
        return self.total


class EventSpans:
    """Spans between timing events recorded on the device's stream, read lazily.

    ``new_event`` makes a timing event (``record``, ``query``, ``synchronize``,
    ``elapsed_time`` in milliseconds, as torch's events have). A span's time is read
    once its end event has completed; ``resolve(wait=True)`` waits for the last ones.
    """

    def __init__(self, new_event: Callable[[], Any]) -> None:
        self.new_event = new_event
        self.total = 0.0
        self._opened: Any = None
        self._pending: deque[tuple[Any, Any]] = deque()

    def open(self) -> None:
        self._opened = self._recorded()

    def close(self) -> None:
        if self._opened is None:
            return
        self._pending.append((self._opened, self._recorded()))
        self._opened = None
        if len(self._pending) >= _RESOLVE_EVERY:
            self.resolve(wait=False)

    def _recorded(self) -> Any:
        event = self.new_event()
        event.record()
        return event

    def resolve(self, wait: bool) -> float:
        while self._pending:
            start, end = self._pending[0]
            if not end.query():
                if not wait:
                    break
                end.synchronize()
            self._pending.popleft()
            self.total += start.elapsed_time(end) / 1000.0
        return self.total


def spans_for(device: torch.device) -> Spans:
    """Host time on the CPU; timing events on an accelerator."""
    if device.type == "cpu":
        return HostSpans()
    if device.type == "cuda":
        return EventSpans(lambda: torch.cuda.Event(enable_timing=True))
    return EventSpans(lambda: torch.Event(device=device, enable_timing=True))


class Goodput:
    """One worker's account of its time since ``begin``.

    ``record`` is the account so far (what rank 0 sends the driver, and returns at the
    end); ``epoch_columns`` the part since the previous call, for metrics.csv.
    """

    def __init__(
        self,
        spans: Spans,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.spans, self.clock, self.wall = spans, clock, wall
        self.attempt = uuid.uuid4().hex  # this worker group's run, as the driver keys it
        self.parts = dict.fromkeys(WORKER_PARTS, 0.0)
        self.began_at: float | None = None  # wall-clock time of the first step's start
        self.first_step = self.step = self.steps = 0
        self._began = 0.0
        self._last_row: tuple[float, dict[str, float]] | None = None

    def begin(self, step: int) -> None:
        """The first step (of this worker group) starts now, at optimizer ``step``."""
        self.began_at, self._began = self.wall(), self.clock()
        self.first_step = self.step = step
        self._last_row = (self._began, dict(self.parts))

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, the wait for each one counted as data wait."""
        return _TimedBatches(self, iter(batches))

    def step_done(self, step: int) -> None:
        """Optimizer ``step`` is over: its compute span ends here."""
        self.spans.close()
        self.step, self.steps = step, self.steps + 1

    @contextlib.contextmanager
    def timing(self, part: str) -> Iterator[None]:
        """Count the time the block takes as ``part`` (``validation_s``, ...)."""
        start = self.clock()
        try:
            yield
        finally:
            self.parts[part] += self.clock() - start

    def add_checkpoint_blocked(self, seconds: float) -> None:
        """The seconds a checkpoint kept this worker from training: the one place they
        are counted (the loop times the report that saves; any other wait for a save in
        flight adds its own seconds here)."""
        self.parts["checkpoint_s"] += seconds

    def record(self) -> dict[str, Any]:
        """The account since ``begin``, without waiting for the device: JSON-able."""
        elapsed = self.clock() - self._began
        parts = _with_compute(self.parts, self.spans.resolve(wait=False), elapsed)
        return {
            "attempt": self.attempt,
            "began_at": self.began_at,
            "at": self.began_at + elapsed if self.began_at is not None else None,
            "first_step": self.first_step,
            "step": self.step,
            "steps": self.steps,
            "elapsed_s": elapsed,
            "parts": parts,
        }

    def epoch_columns(self) -> dict[str, float]:
        """metrics.csv's ``time_*`` columns: the seconds of each part since the previous
        call (or ``begin``), ``time_other_s`` the rest; waits for the device's spans."""
        now, compute = self.clock(), self.spans.resolve(wait=True)
        since, before = self._last_row or (self._began, dict.fromkeys(WORKER_PARTS, 0.0))
        totals = {**self.parts, "compute_s": compute}
        self._last_row = (now, totals)
        delta = {part: totals[part] - before[part] for part in WORKER_PARTS}
        parts = _with_compute(delta, delta["compute_s"], now - since)
        return {f"time_{part}": seconds for part, seconds in parts.items()}


def _with_compute(parts: dict[str, float], compute: float, elapsed: float) -> dict[str, float]:
    """``parts`` with ``compute_s`` and ``other_s`` over ``elapsed`` seconds.

    Device time may reach past the host's interval (a span queued inside it, run after
    it): compute is at most what the other parts leave, and other the remainder.
    """
    host = sum(seconds for part, seconds in parts.items() if part != "compute_s")
    compute = max(0.0, min(compute, elapsed - host))
    out = {**parts, "compute_s": compute}
    out["other_s"] = max(0.0, elapsed - host - compute)
    return out


class _TimedBatches:
    """An iterator over batches that times each wait for the next one.

    Asking for a batch ends the compute span the previous one opened; the time until it
    arrives is data wait; its arrival opens the next compute span.
    """

    def __init__(self, goodput: Goodput, batches: Iterator[Any]) -> None:
        self.goodput, self.batches = goodput, batches

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        goodput = self.goodput
        goodput.spans.close()
        start = goodput.clock()
        try:
            batch = next(self.batches)
        finally:
            goodput.parts["data_wait_s"] += goodput.clock() - start
        goodput.spans.open()
        return batch
