"""Processes found by a marker in their command line, and stopped by PID.

``ray stop`` stops every Ray process on the machine. A Ray instance started with its own
temp dir is stopped alone instead: its processes name that dir on their command lines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

# The instances stopped here are thrown away (their temp dir is deleted next), so SIGTERM
# only lets a process exit tidily. Some of Ray's processes take over 10 s to honour it while
# a job is torn down; a longer grace would only add waiting before the SIGKILL that follows.
TERM_GRACE_S = 3.0
KILL_WAIT_S = 5.0  # how long SIGKILLed processes may take to disappear from /proc
_POLL_S = 0.2


def pids_naming(*markers: str) -> list[int]:
    """PIDs of the processes, other than this one, whose command line contains every one
    of ``markers`` (arguments are NUL-separated there: "\\0" ends one)."""
    needles = [marker.encode() for marker in markers]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if all(needle in cmdline for needle in needles):
                found.append(int(entry.name))
        except OSError:  # it exited while we looked
            continue
    return found


def descendants(pid: int) -> set[int]:
    """Every process started by ``pid``, and by those, and so on (from /proc's parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The fields after the command name, which may itself hold spaces or ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def wait_until_gone(*markers: str, timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for every process naming ``markers`` to exit; those left."""
    deadline = time.monotonic() + timeout_s
    while (left := pids_naming(*markers)) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return left


def stop_processes_naming(*markers: str) -> None:
    """SIGTERM every process naming all ``markers``, then SIGKILL those left after a grace."""
    for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        for pid in pids_naming(*markers):
            with contextlib.suppress(ProcessLookupError):  # it may have exited already
                os.kill(pid, sig)
        if not wait_until_gone(*markers, timeout_s=wait_s):
            return
