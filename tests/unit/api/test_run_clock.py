"""When a run began: the `raytrain` command's first import, or `train()`'s call from Python."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time

from raytrain_app import run_clock

_CHILD = """
import sys, time
import raytrain_app  # the console script's first import
from raytrain_app import run_clock
time.sleep(0.5)  # as the imports and checks take before train() is called
called_at = time.time()
run_clock.mark_command_start()
modules = list(sys.modules)
first = modules.index("raytrain_app.run_clock") < modules.index("pydantic")
print(run_clock.run_began_at(called_at), called_at, first)
"""


def test_a_command_counts_from_raytrains_first_import_not_from_the_shell_that_execd_it():
    """A shell that stages data for a second, then execs the command (a batch script, a
    container entrypoint's ``exec "$@"``): the process keeps the shell's start, and the
    run must not count the shell's second as its start-up."""
    child = f"{shlex.quote(sys.executable)} -c {shlex.quote(_CHILD)}"
    launched = time.time()
    done = subprocess.run(
        ["bash", "-c", f"sleep 1 && exec {child}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    began, called, first = done.stdout.split()
    assert float(began) >= launched + 1.0, (launched, began)  # not the shell's start
    assert float(called) - float(began) >= 0.5  # the command's imports and checks count
    assert first == "True"  # stamped before raytrain_app's own imports (pydantic: 0.9 s)


def test_a_run_from_python_counts_from_the_call(monkeypatch):
    monkeypatch.setattr(run_clock, "_command_began_at", None)
    assert run_clock.run_began_at(1234.5) == 1234.5


def test_a_command_counts_from_its_start_even_where_train_is_called_later(monkeypatch):
    monkeypatch.setattr(run_clock, "_command_began_at", None)
    run_clock.mark_command_start()
    assert run_clock.run_began_at(run_clock._IMPORTED_AT + 3.0) == run_clock._IMPORTED_AT
