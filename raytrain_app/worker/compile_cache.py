"""torch.compile's cache in a folder no other user can write.

Inductor keeps what it compiles (Python modules it imports, shared libraries it loads,
Triton kernels) in ``TORCHINDUCTOR_CACHE_DIR``, by default ``<tmp>/torchinductor_<user>``:
a name that any other user of a shared node (an HPC login or compute node, a shared
workstation) can create first and fill with code that this user's next compile would
load and run. Before the worker's first compile, raytrain keeps that default only where it
is this user's own folder that no one else can write (creating it so where it does not
exist yet); otherwise the worker compiles into a new private folder, whose cache starts
empty, and says why. A ``TORCHINDUCTOR_CACHE_DIR`` the user set is theirs and left alone.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def use_private_compile_cache() -> Path | None:
    """Point inductor at a cache folder only this user can write, unless the user chose one;
    the folder (None where the user's choice stands)."""
    if os.environ.get(CACHE_VARIABLE):
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = Path(default_cache_dir())
    if _made_private(default) or _is_private(default):
        chosen = default
    else:
        chosen = Path(tempfile.mkdtemp(prefix="raytrain-torchinductor-"))  # mode 0700
        logger.warning(
            "%s, torch.compile's default cache, is not a folder that only you can write "
            "(another user could leave code there that compiling would load); compiling "
            "into %s instead, whose cache starts empty. Remove that folder, or set %s to "
            "a private one, to keep compiled kernels between runs",
            default,
            chosen,
            CACHE_VARIABLE,
        )
    os.environ[CACHE_VARIABLE] = str(chosen)
    return chosen


def _made_private(path: Path) -> bool:
    """Whether ``path`` was made now, 0700 (not where it exists, or cannot be made)."""
    try:
        path.mkdir(mode=0o700)
    except OSError:
        return False
    return True


def _is_private(path: Path) -> bool:
    """A real folder (no link), owned by this user, that neither its group nor others
    can write."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )
