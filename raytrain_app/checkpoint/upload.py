"""Putting a checkpoint into the run's storage so that a kill mid-way never leaves a torn
one under a real name (run by the checkpoint writer, ``writer.py``, of the rank that
writes the checkpoint, or of every rank when each writes its part of a sharded one)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raytrain_app.checkpoint.store import MANIFEST_FILE

# Filesystems that rename a directory at once. Object stores (S3, GCS) have no directories
# to rename: a "rename" copies every object, and pyarrow's S3 refuses it for a directory.
_RENAMING_FILESYSTEMS = ("local", "hdfs")


def upload_shards_atomically(
    checkpoint: Any, name: str, storage: Any = None, group: Any = None
) -> Any:
    """``upload_atomically`` for a checkpoint that every rank writes a part of (FSDP's
    shards, ``sharded.py``), run by every rank, its collectives over ``group`` (None: the
    default group; the checkpoint writer's own group while training uses that one).

    Rank 0 chooses the name; every rank copies its files into one ``.partial`` directory
    (Ray's controller wants one path from all ranks); once all have, rank 0 renames it (or,
    on an object store, puts its manifest last), so the checkpoint appears whole or not
    at all wherever the ranks run.

    ``storage``: where the run's checkpoints go (Ray Train's ``StorageContext`` by default;
    in Ray Train's local mode, which has none, ``worker.local_mode.RunStorage``).
    """
    import pyarrow.fs
    import ray.train
    import torch.distributed as dist

    storage = storage or ray.train.get_context().get_storage()
    fs = storage.storage_filesystem
    chosen = [_free_path(storage, fs, name) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0, group=group)
    final = chosen[0]
    renaming = fs.type_name in _RENAMING_FILESYSTEMS
    target = final + ".partial" if renaming else final
    if dist.get_rank() == 0 and renaming:
        if fs.get_file_info(target).type != pyarrow.fs.FileType.NotFound:
            fs.delete_dir(target)  # left by a worker killed mid-copy
        fs.create_dir(target)
    dist.barrier(group=group)
    source = Path(checkpoint.path)
    files = sorted(p for p in source.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    for file in files:
        _copy_file(file, f"{target}/{file.name}", checkpoint.filesystem, fs)
    dist.barrier(group=group)  # every rank's files are in place
    if dist.get_rank() == 0:
        if (source / MANIFEST_FILE).is_file():
            _copy_file(
                source / MANIFEST_FILE, f"{target}/{MANIFEST_FILE}", checkpoint.filesystem, fs
            )
        if renaming:
            fs.move(target, final)
    dist.barrier(group=group)  # reported only once it is complete under its name
    return ray.train.Checkpoint(final, filesystem=fs)


def _free_path(storage: Any, fs: Any, name: str) -> str:
    """Where the checkpoint ``name`` goes; a name already taken (the same step written again
    after a restart from an older checkpoint) gets ``-rN``, so Ray's bookkeeping never
    holds two entries for one directory."""
    import pyarrow.fs

    final, attempt = storage.build_checkpoint_path_from_name(name), 1
    while fs.get_file_info(final).type != pyarrow.fs.FileType.NotFound:
        final = storage.build_checkpoint_path_from_name(f"{name}-r{attempt}")
        attempt += 1
    return final


def _copy_file(file: Path, destination: str, source_fs: Any, fs: Any) -> None:
    import pyarrow.fs

    pyarrow.fs.copy_files(
        str(file), destination, source_filesystem=source_fs, destination_filesystem=fs
    )


def save_atomically(write: Callable[[Path], Any], name: str, storage: Any = None) -> Any:
    """Put the checkpoint that ``write(directory)`` writes into the run's storage as
    ``name``, so that a kill mid-way never leaves a torn one under a real name.

    On a local or mounted filesystem it is written in place under ``<name>.partial`` and
    renamed once complete: no copy of it is made. Elsewhere (object stores, HDFS) it is
    written into a local scratch directory, then uploaded (``upload_atomically``).
    ``storage`` as in ``upload_shards_atomically``.
    """
    import ray.train

    storage = storage or ray.train.get_context().get_storage()
    fs = storage.storage_filesystem
    if fs.type_name != "local":
        with scratch_dir() as directory:
            write(directory)
            return upload_atomically(ray.train.Checkpoint.from_directory(directory), name, storage)
    final = _free_path(storage, fs, name)
    write_in_place(write, Path(final))
    return ray.train.Checkpoint(final, filesystem=fs)


def write_in_place(write: Callable[[Path], Any], final: Path) -> Path:
    """``write(<final>.partial)`` on a local or mounted filesystem, renamed to ``final``
    once complete: a write that fails leaves nothing, a kill only the ``.partial``, which
    the next write of that name replaces."""
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a worker killed mid-way
    partial.mkdir(parents=True)
    try:
        write(partial)
    except Exception:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return partial.rename(final)


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A local temporary directory for a checkpoint on its way to the run's storage."""
    with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as directory:
        yield Path(directory)


def _fresh_partial(fs: Any, final: str) -> str:
    """``<final>.partial``, created empty (what a worker killed mid-way left is deleted)."""
    import pyarrow.fs

    partial = final + ".partial"
    if fs.get_file_info(partial).type != pyarrow.fs.FileType.NotFound:
        fs.delete_dir(partial)
    fs.create_dir(partial)
    return partial


def upload_atomically(checkpoint: Any, name: str, storage: Any = None) -> Any:
    """Copy a checkpoint into the run's storage under a temporary name, then rename it.

    A worker killed mid-copy leaves only a ``.partial`` directory, never a torn checkpoint
    under a real name (on object stores, where a rename is a copy, the manifest still
    catches a torn one). ``storage`` as in ``upload_shards_atomically``.
    """
    import pyarrow.fs
    import ray.train

    storage = storage or ray.train.get_context().get_storage()
    fs = storage.storage_filesystem
    final = _free_path(storage, fs, name)
    if fs.type_name not in _RENAMING_FILESYSTEMS:
        return _upload_manifest_last(checkpoint, final, fs)
    partial = _fresh_partial(fs, final)
    pyarrow.fs.copy_files(
        checkpoint.path,
        partial,
        source_filesystem=checkpoint.filesystem,
        destination_filesystem=fs,
    )
    fs.move(partial, final)
    return ray.train.Checkpoint(final, filesystem=fs)


def _upload_manifest_last(checkpoint: Any, final: str, fs: Any) -> Any:
    """Put the checkpoint's files straight under ``final`` in an object store, the manifest
    last: a copy cut short has no manifest, so ``verify_checkpoint`` refuses it and a
    resume falls back to an older one."""
    import pyarrow.fs
    import ray.train

    source = Path(checkpoint.path)
    files = sorted(p for p in source.rglob("*") if p.is_file())
    for file in sorted(files, key=lambda p: p.name == MANIFEST_FILE):
        pyarrow.fs.copy_files(
            str(file),
            f"{final}/{file.relative_to(source).as_posix()}",
            source_filesystem=checkpoint.filesystem,
            destination_filesystem=fs,
        )
    return ray.train.Checkpoint(final, filesystem=fs)
