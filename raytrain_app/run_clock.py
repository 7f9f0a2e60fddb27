"""When a run began, by the wall clock: goodput's start-up counts from it.

A ``raytrain`` command began when raytrain's own code started: ``raytrain_app`` imports
this module before anything else, so its import stamps that moment, and what follows
(pydantic, torch, Ray, the checks) counts as start-up, since the user waits through it.
Not the process's start as the kernel records it: that is the start of whatever exec'd
the command (``bash -c "stage-data && raytrain train"``, a container entrypoint's
``exec "$@"``, a batch script), which would count the shell's earlier work as the run's;
the interpreter's own start before this import (0.04 s here) is left out with it. A run
from Python (a notebook, a script) began when ``raytrain_app.train`` was called.
"""

from __future__ import annotations

import time

_IMPORTED_AT = time.time()  # first in raytrain_app's __init__: see the module docstring
_command_began_at: float | None = None


def mark_command_start() -> None:
    """This process is a ``raytrain`` command: runs it starts count from its start."""
    global _command_began_at
    _command_began_at = _IMPORTED_AT


def run_began_at(called_at: float) -> float:
    """The start of the run whose ``train`` was called at ``called_at`` (wall clock)."""
    return min(_command_began_at, called_at) if _command_began_at is not None else called_at
