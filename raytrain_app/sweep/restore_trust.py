"""Whether a sweep's saved Tune state may be restored: Tune unpickles it.

``tune.Tuner.restore`` reads ``tuner.pkl``, the searcher's state and the experiment state
(trials cloudpickled inside JSON) with pickle, and raytrain cannot read those as data
instead: whoever can write them runs code in the driver that resumes the sweep. So a
resume goes ahead only from a sweep directory that is this user's own: on a filesystem,
every file and folder of it owned by this user and writable by no one else (group
members, as on a project directory with umask 002, count as trusted); in an object
store, where raytrain cannot see who wrote an object, only with ``--trust-code``.
The trials' checkpoints are raytrain's own and load as data whatever their owner.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from raytrain_app.checkpoint.trust import TRUST_FLAG
from raytrain_app.errors import BadInputError
from raytrain_app.storage import StorageLocation


def check_restorable(experiment: StorageLocation, trust_code: bool) -> None:
    """Refuse to restore the Tune state in ``experiment`` unless it is this user's.

    Raises:
        BadInputError: a file is another user's or writable by anyone (a filesystem), or
            the state is in an object store and ``trust_code`` is off.
    """
    if trust_code:
        return
    if not experiment.is_local:
        raise BadInputError(
            f"resuming the sweep in '{experiment.uri}' would unpickle Tune's saved state from "
            f"the bucket, which anyone who can write there could have replaced; pass "
            f"{TRUST_FLAG} if only people you trust can write to it, or start a new sweep "
            f"(experiment.name)"
        )
    foreign = _first_foreign(experiment.local_path)
    if foreign is not None:
        raise BadInputError(
            f"resuming the sweep in '{experiment.local_path}' would unpickle Tune's saved "
            f"state, and '{foreign}' is another user's or writable by anyone; start a new "
            f"sweep (experiment.name), or pass {TRUST_FLAG} if you trust who wrote it"
        )


def _first_foreign(root: Path) -> Path | None:
    """The first path under ``root`` (itself included) not owned by this user or writable
    by others; None when the whole tree is this user's."""
    uid = os.getuid()
    for folder, _, files in os.walk(root):
        for path in [Path(folder), *(Path(folder) / name for name in files)]:
            try:
                info = path.stat()  # what a link points to is what Tune reads
            except OSError:  # a dangling link: nothing to read
                continue
            if info.st_uid != uid or info.st_mode & stat.S_IWOTH:
                return path
    return None
