"""Stop signals: Ctrl-C, SIGUSR1 (SLURM's warning before a time limit) and SIGTERM ask the
run to checkpoint at the next step and stop, instead of losing the work since the last one."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The signals that ask a run to checkpoint at the next step and stop: Ctrl-C, SLURM's
# warning before a time limit or preemption (the script asks for SIGUSR1), and SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)


@contextmanager
def stop_on_signals(stop_file: Path) -> Iterator[list[str]]:
    """Any of ``STOP_SIGNALS`` asks the workers to checkpoint at the next step and stop;
    a second one interrupts at once.

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
        stop_file.touch()  # rank 0 polls for it between steps

    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
