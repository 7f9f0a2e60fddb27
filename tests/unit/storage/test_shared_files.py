"""Folders a team shares (``data.cache_dir``, a run directory on NFS): what raytrain writes
there gets the mode a plain write gets under the writer's umask, so another user reads a
shared cache when the umask lets them (``tempfile.mkstemp`` made every file 0600), and a
folder the writer may not write is one line naming it and the fix.

Another user is real here: CI runs as root, which reads as ``nobody`` with ``runuser``
(util-linux) and writes as ``nobody`` in a forked child that gives up root."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from stream_data import PARAMS, ROWS_PER_GROUP, series_table, write_files

from raytrain_app.config import RaytrainConfig, save_config
from raytrain_app.data import synthetic_wind
from raytrain_app.data.stream_prepare import prepare_stream
from raytrain_app.errors import BadInputError
from raytrain_app.storage import StorageLocation

as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)"
)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user can reach (pytest's tmp_path is its owner's alone: 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="raytrain-shared-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def umask(monkeypatch) -> Iterator[Callable[[int], None]]:
    """Sets this process's umask for the test, as the user's shell would. The prepare pass
    runs in this process too: beside the distributed tier's session Ray (``pytest -n``) it
    would otherwise run in Ray's workers, whose umask is the one Ray started with."""
    monkeypatch.setattr("raytrain_app.data.stream_prepare._ray_initialized", lambda: False)
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


def write_everything(folder: Path) -> list[Path]:
    """Every kind of file raytrain writes into a shared folder; returns them all."""
    StorageLocation.local(folder / "run" / "summary.json").write_text("{}")
    save_config(RaytrainConfig(), folder / "run" / "config.yaml")
    synthetic_wind.materialize(folder / "cache", num_turbines=2, num_hours=48, seed=0)
    source = write_files(folder / "source", series_table())
    prepare_stream(str(source), PARAMS, folder / "cache", rows_per_group=ROWS_PER_GROUP)
    written = [p for p in (folder / "run").rglob("*") if p.is_file()]
    written += [p for p in (folder / "cache").rglob("*") if p.is_file()]
    assert {p.suffix for p in written} >= {".json", ".yaml", ".parquet"}, written
    return written


@pytest.mark.parametrize(
    ("mask", "mode"),
    [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)],
    ids=["umask_022", "umask_002", "umask_077_kept_private"],
)
def test_files_get_the_mode_a_plain_write_gets_under_the_umask(shared, umask, mask, mode):
    # before: 0600 whatever the umask, so no one else could read a shared cache
    umask(mask)
    modes = {
        p.relative_to(shared): stat.S_IMODE(p.stat().st_mode) for p in write_everything(shared)
    }
    assert modes == dict.fromkeys(modes, mode)


@as_root
def test_another_user_reads_a_shared_cache_and_run_directory(shared, umask):
    umask(0o022)
    written = write_everything(shared)
    read = subprocess.run(
        ["runuser", "-u", "nobody", "--", "cat", *map(str, written)],
        capture_output=True,
        check=False,
    )
    assert read.returncode == 0, read.stderr.decode()
    assert len(read.stdout) == sum(p.stat().st_size for p in written)


def _as_nobody(write: Callable[[], object]) -> str:
    """What ``write`` raises in a child process running as ``nobody`` (root gives it up
    for good there): the message of a BadInputError, or the name of anything else."""
    nobody = pwd.getpwnam("nobody")
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        outcome = "wrote"
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            write()
        except BadInputError as exc:
            outcome = str(exc)
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(writer, outcome.encode())
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        outcome = pipe.read().decode()
    os.waitpid(child, 0)
    return outcome


@as_root
@pytest.mark.parametrize(
    "write",
    [
        lambda folder: StorageLocation.local(folder / "cache" / "manifest.json").write_text("{}"),
        lambda folder: save_config(RaytrainConfig(), folder / "config.yaml"),
        lambda folder: synthetic_wind.materialize(folder, num_turbines=2, num_hours=48, seed=0),
        lambda folder: StorageLocation.local(folder / "plot" / "loss.png").upload(Path(__file__)),
    ],
    ids=["location", "config", "synthetic_cache", "upload"],
)
def test_a_folder_the_user_may_not_write_is_one_line_naming_it(shared, write):
    # before: a PermissionError's traceback from deep inside tempfile or pyarrow
    message = _as_nobody(lambda: write(shared))
    assert message.startswith("cannot write ") and "\n" not in message, message
    assert f"may not write in {shared}; give it write access there" in message
    assert list(shared.iterdir()) == []  # nothing left behind
