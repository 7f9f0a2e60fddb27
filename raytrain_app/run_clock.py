"""When a run began, by the wall clock: goodput's start-up counts from it.

A ``raytrain`` command began when its process started (the interpreter's start and the
imports are part of the user's wait for the first step); a run from Python (a notebook, a
script) began when ``raytrain_app.train`` was called. Imports nothing heavy: the CLI
reads it before anything else.
"""

from __future__ import annotations

import os
import sys
import time

_IMPORTED_AT = time.time()  # early in any raytrain command: the fallback off Linux
_command_began_at: float | None = None


def mark_command_start() -> None:
    """This process is a ``raytrain`` command: runs it starts count from its start."""
    global _command_began_at
    _command_began_at = process_started_at()


def run_began_at(called_at: float) -> float:
    """The start of the run whose ``train`` was called at ``called_at`` (wall clock)."""
    return min(_command_began_at, called_at) if _command_began_at is not None else called_at


def process_started_at() -> float:
    """This process's start (wall clock, to the kernel's 10 ms tick on Linux); elsewhere
    the import of this module, which every raytrain command does first."""
    if not sys.platform.startswith("linux"):
        return _IMPORTED_AT
    try:
        with open("/proc/self/stat") as stat:
            # fields after the command name (which may hold spaces): starttime is the 20th
            after_name = stat.read().rsplit(")", 1)[1].split()
        started_since_boot = int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT
    since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - started_since_boot
    return time.time() - since_start
