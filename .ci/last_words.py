"""pytest plugin for CI: what a pytest process was doing when it ended before its summary.

Stop 49's CI: the compatibility tier's unit tests (idle class, beside the main suite) ended
with status 1 in the middle of tests/unit/checkpoint/test_data_identity.py, with no summary
and no traceback. That module passes alone, on either Ray, in 2 s. pytest writes its
progress through a buffer, so a process that ends without Python's own exit (``os._exit``,
a library's C ``exit()``) loses the buffer and says nothing of which test or why.

With ``RAYTRAIN_CI_LAST_WORDS=<file>``, this plugin writes there, a line at a time as they
happen: each test's node id as it starts, the Python stack of any ``os._exit`` called in
this process, and a last line once the session has finished. ``.ci/oldest-ray`` prints the
file where that last line is missing (it greps for ``FINISHED``). Loaded with ``-p
last_words``, ``.ci`` put first on ``sys.path`` by the command that starts pytest.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import TextIO

FINISHED = "session finished"

_file: TextIO | None = None


def pytest_configure(config) -> None:
    global _file
    path = os.environ.get("RAYTRAIN_CI_LAST_WORDS")
    if not path or _file is not None:
        return
    _file = open(path, "w", buffering=1)  # noqa: SIM115 - open for the whole session
    _file.write(f"pytest pid {os.getpid()}\n")
    pytest_pid, real_exit = os.getpid(), os._exit

    def exit_with_last_words(code: int) -> None:
        # Forked children (a DataLoader's workers, multiprocessing's fork) end through
        # os._exit too and share the file: only this process's own call is news.
        if os.getpid() == pytest_pid and _file is not None:
            _file.write(f"os._exit({code}) called from (innermost last):\n")
            traceback.print_stack(sys._getframe(1), limit=12, file=_file)
            _file.flush()
        real_exit(code)

    os._exit = exit_with_last_words


def pytest_runtest_logstart(nodeid: str, location) -> None:
    if _file is not None:
        _file.write(f"started {nodeid}\n")


def pytest_sessionfinish(session, exitstatus) -> None:
    if _file is not None:
        _file.write(f"{FINISHED} (exit status {int(exitstatus)})\n")
