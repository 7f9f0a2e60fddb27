"""When a run began: the `raytrain` command's process start, or `train()`'s call from Python."""

from __future__ import annotations

import subprocess
import sys
import time

from raytrain_app import run_clock

_CHILD = """
import time
time.sleep(0.5)  # as the interpreter's start and the imports take before train() is called
from raytrain_app import run_clock
called_at = time.time()
run_clock.mark_command_start()
print(run_clock.run_began_at(called_at), called_at)
"""


def test_a_command_run_counts_from_the_process_start_not_the_call():
    launched = time.time()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    began, called = map(float, done.stdout.split())
    # the kernel stamps a process's start in 10 ms ticks
    assert launched - 0.02 <= began <= launched + 0.3, (launched, began)
    assert called - began >= 0.5


def test_a_run_from_python_counts_from_the_call(monkeypatch):
    monkeypatch.setattr(run_clock, "_command_began_at", None)
    assert run_clock.run_began_at(1234.5) == 1234.5


def test_the_process_start_is_in_the_past_of_this_process():
    started = run_clock.process_started_at()
    assert started <= time.time()
    assert started <= run_clock._IMPORTED_AT + 0.02  # pytest imported it after starting
