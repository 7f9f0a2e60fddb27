"""What an attacker would name in a hand-edited ``meta.json``: a factory that runs a
process. Importing this module or calling it leaves a marker file, so a test can prove that
neither happened (the marker's path comes from RAYTRAIN_TEST_MARKER or the params)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_MARKER = os.environ.get("RAYTRAIN_TEST_MARKER")
if _MARKER:
    Path(_MARKER + ".imported").write_text("imported\n")


def launch(params: dict, info: dict) -> None:
    """Run ``touch <params["marker"]>`` as a process, as a real launcher would."""
    subprocess.run(["touch", params["marker"]], check=True)
