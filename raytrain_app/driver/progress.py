"""The progress the driver shows from rank 0's snapshots (``run_control`` fetches them).

A terminal or a notebook gets a bar (``tqdm.auto`` renders as a widget in notebooks).
A log file (a SLURM ``.out``, a Ray job's logs: stderr is not a terminal) gets a plain line
every 30 s instead, since every redraw of a bar would land in it as one more frame of a
single line.
Nothing on the training hot path waits for the driver.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Protocol, TextIO

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.5
# How often a log file gets a progress line.
LINE_INTERVAL_S = 30.0


class Progress(Protocol):
    def show(self, snap: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def progress_for(stream: TextIO | None = None) -> Progress:
    """Bars where someone watches them redraw, plain lines where they are logged."""
    stream = stream or sys.stderr
    return EpochBars() if _redraws(stream) else ProgressLines()


def _redraws(stream: TextIO) -> bool:
    if getattr(stream, "isatty", lambda: False)():
        return True
    # A Jupyter kernel's stderr is no terminal, but tqdm.auto draws a widget there.
    shell = sys.modules.get("IPython")
    ipython = shell.get_ipython() if shell and hasattr(shell, "get_ipython") else None
    return ipython is not None and "IPKernelApp" in getattr(ipython, "config", {})


class ProgressLines:
    """A plain log line at most every ``interval_s``; each epoch's end is rank 0's own
    epoch line, which the log already has."""

    def __init__(self, interval_s: float = LINE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()

    def show(self, snap: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        logger.info(
            "epoch %d/%d: step %d/%d, loss %.4f, %.0f samples/s, %s worker(s)",
            snap["epoch"],
            snap["epochs"],
            snap["step"],
            snap["steps"],
            snap["loss"],
            snap["samples_per_s"],
            snap["workers"],
        )

    def close(self) -> None:
        return None


class EpochBars:
    """One tqdm bar per epoch, drawn from rank 0's snapshots."""

    def __init__(self, **tqdm_kwargs: Any) -> None:
        self._tqdm_kwargs = {"leave": True, "dynamic_ncols": True, **tqdm_kwargs}
        self._bar: tqdm | None = None
        self._epoch: int | None = None

    def show(self, snap: dict[str, Any]) -> None:
        if snap["epoch"] != self._epoch:
            self.close()
            self._epoch = snap["epoch"]
            # The first snapshot of an epoch arrives some steps in: those steps are where
            # the bar starts, not progress made in no time (a rate of 500,000 steps/s).
            self._bar = tqdm(
                total=snap["steps"],
                initial=snap["step"],
                desc=f"epoch {self._epoch}/{snap['epochs']}",
                unit="step",
                **self._tqdm_kwargs,
            )
        self._bar.update(snap["step"] - self._bar.n)
        self._bar.set_postfix(
            loss=f"{snap['loss']:.4f}",
            samples_s=f"{snap['samples_per_s']:.0f}",
            workers=snap["workers"],  # an elastic run changes its size
            refresh=False,
        )
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
