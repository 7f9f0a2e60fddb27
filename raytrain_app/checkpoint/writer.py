"""One checkpoint writer per rank, with at most one save in flight.

At a checkpoint step the loop only takes a snapshot of what it saves (host-memory copies,
``snapshot.py``) and hands the rest to this writer: serialising, digesting and putting the
files into the run's storage run on its thread while training goes on. The next
checkpoint first waits for the save in flight (the snapshot's buffers are reused), and
that wait is part of the time the checkpoint blocked the step.

A thread, not a process: on this project's 2-core machine a writer process slowed the
step no less than a thread (benchmarks/README.md, "Checkpoints off the step's path"),
and a thread needs no shared memory for the snapshot and serves FSDP's collective DCP
save alike. The save lets the GIL go while it copies, digests and writes each tensor's
record (``direct_file.py``), so the thread takes no more from the training thread than a
process would. The thread keeps the training's CPU priority: at a lower one (tried:
nice 19) a busy host starved it while it held the GIL, which stalls the training thread
instead, and a save left in flight for many steps is a save a failure loses.

Without ``background`` (a Tune trial, or ``train.async_checkpoints: false``) a save runs
at once in the caller's thread, as before there was a writer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)


class CheckpointWriter:
    """Runs checkpoint saves one at a time, in the background or inline."""

    def __init__(self, background: bool) -> None:
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-checkpoint")
            if background
            else None
        )
        self._in_flight: Future | None = None

    @property
    def background(self) -> bool:
        return self._executor is not None

    def submit(self, save: Callable[[], Any]) -> Future:
        """Start ``save`` once the save in flight (if any) has ended; a future of what it
        returns. Inline, ``save`` has run when this returns, and its error is raised here.

        Raises:
            Exception: the save in flight failed (the run cannot go on without it).
        """
        self.wait()
        if self._executor is None:
            done: Future = Future()
            done.set_result(save())
            return done
        self._in_flight = self._executor.submit(save)
        return self._in_flight

    def wait(self) -> None:
        """Wait for the save in flight to end; raise its error."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def close(self) -> None:
        """Let the save in flight end and stop the thread, raising nothing: called when
        the run is failing anyway, where a save that fails too leaves the previous
        checkpoint the newest whole one."""
        try:
            self.wait()
        except Exception as exc:  # the run's own error is the one to report
            logger.warning("the checkpoint being saved when the run failed was lost: %s", exc)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
