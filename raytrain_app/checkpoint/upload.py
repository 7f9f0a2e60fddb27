"""Putting a checkpoint into the run's storage so that a kill mid-copy never leaves a torn
one under a real name (Ray Train's ``checkpoint_upload_fn``, run in the reporting worker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_app.checkpoint.store import MANIFEST_FILE

# Filesystems that rename a directory at once. Object stores (S3, GCS) have no directories
# to rename: a "rename" copies every object, and pyarrow's S3 refuses it for a directory.
_RENAMING_FILESYSTEMS = ("local", "hdfs")


def upload_atomically(checkpoint: Any, name: str) -> Any:
    """Copy a checkpoint into the run's storage under a temporary name, then rename it.

    A worker killed mid-copy leaves only a ``.partial`` directory, never a torn checkpoint
    under a real name (on object stores, where a rename is a copy, the manifest still
    catches a torn one).
    """
    import pyarrow.fs
    import ray.train

    storage = ray.train.get_context().get_storage()
    fs = storage.storage_filesystem
    final = storage.build_checkpoint_path_from_name(name)
    # The same step written again (after a restart from an older checkpoint): a new name,
    # so Ray's bookkeeping never holds two entries for one directory.
    attempt = 1
    while fs.get_file_info(final).type != pyarrow.fs.FileType.NotFound:
        final = storage.build_checkpoint_path_from_name(f"{name}-r{attempt}")
        attempt += 1
    if fs.type_name not in _RENAMING_FILESYSTEMS:
        return _upload_manifest_last(checkpoint, final, fs)
    partial = final + ".partial"
    if fs.get_file_info(partial).type != pyarrow.fs.FileType.NotFound:
        fs.delete_dir(partial)  # left by a worker killed mid-copy
    fs.create_dir(partial)
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
