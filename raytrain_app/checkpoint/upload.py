"""Putting a checkpoint into the run's storage so that a kill mid-copy never leaves a torn
one under a real name (Ray Train's ``checkpoint_upload_fn``, run in the reporting worker)."""

from __future__ import annotations

from typing import Any


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
