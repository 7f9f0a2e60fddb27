"""A private HOME and environment, so Ray never touches the user's ``~/.ray`` or clusters.

Ray 2.60 writes ``~/.ray/auth_token`` when it has to generate a token, whatever
``RAY_AUTH_TOKEN_PATH`` says; and an inherited ``RAY_ADDRESS`` or token would send a child
process to someone else's cluster.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Variables (or prefixes of them) that point a process at a cluster or let it in: never
# inherited by an isolated process.
CLUSTER_VARIABLES = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_")


def ray_temp_dir(prefix: str = "rt-") -> str:
    """A fresh Ray temp dir under /tmp: Ray's Unix socket paths, under it, must stay < 108 bytes."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def isolated_env(home: Path, *, without: tuple[str, ...] = (), **set_vars: str) -> dict[str, str]:
    """This process's environment for a child that may start or join Ray.

    Args:
        home: the child's HOME (created), where Ray keeps ``~/.ray``.
        without: more variables to leave out, as names or prefixes of names.
        set_vars: variables to set last (they win over everything above).

    Returns:
        The environment, with no cluster variables and this interpreter's scripts (``ray``,
        ``raytrain``) first on PATH.
    """
    dropped = CLUSTER_VARIABLES + without
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    home.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    env.update(set_vars)
    return env


def _replaced_by_private_home(key: str) -> bool:
    return key == "HOME" or key.startswith(CLUSTER_VARIABLES)


@contextlib.contextmanager
def private_home(home: Path) -> Iterator[Path]:
    """Point this process's HOME at ``home`` (created) without cluster variables; restore after."""
    saved = {k: v for k, v in os.environ.items() if _replaced_by_private_home(k)}
    for key in saved:
        del os.environ[key]
    home.mkdir(parents=True, exist_ok=True)
    os.environ["HOME"] = str(home)
    try:
        yield home
    finally:
        for key in [k for k in os.environ if _replaced_by_private_home(k)]:
            del os.environ[key]
        os.environ.update(saved)
