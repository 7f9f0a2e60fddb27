"""Stop signals: Ctrl-C, SIGUSR1 (SLURM's warning before a time limit) and SIGTERM ask the
run to checkpoint at the next step and stop, instead of losing the work since the last one."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The signals that ask a run to checkpoint at the next step and stop: Ctrl-C, SLURM's
# warning before a time limit or preemption (the script asks for SIGUSR1), and SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[list[str]]:
    """Any of ``STOP_SIGNALS`` sets ``stop`` (the run control passes it on to the workers,
    which checkpoint at the next step and stop); a second one interrupts at once.

    Yields the names of the signals received. Outside the main thread (a notebook's
    worker thread) signals cannot be caught and nothing is installed.
    """
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def request_stop(signum: int, frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        if len(received) > 1:
            raise KeyboardInterrupt
        # Only a flag here: a signal handler must not call into Ray, whose calls it may
        # have interrupted; the run control's thread sends the request.
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def sigterm_exits_through_finally() -> Iterator[None]:
    """Where SIGTERM would kill the process outright, make it exit through ``finally`` blocks
    instead, so that the run directory's lease is released (``stop_on_signals``, installed
    inside, takes precedence while the run trains)."""
    in_main = threading.current_thread() is threading.main_thread()
    if not in_main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def exit_on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is exit_on_sigterm:  # not replaced by someone else
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
