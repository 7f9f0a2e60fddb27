"""Persisting a checkpoint into the run's storage: copied under a temporary name, renamed."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs
import pytest
import ray.train
from torch import nn

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.upload import save_atomically, upload_atomically


@pytest.fixture
def storage(tmp_path, monkeypatch):
    """The run's experiment folder, as Ray Train's storage context exposes it."""
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    context = SimpleNamespace(
        storage_filesystem=pyarrow.fs.LocalFileSystem(),
        build_checkpoint_path_from_name=lambda name: str(experiment / name),
    )
    monkeypatch.setattr(
        ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: context)
    )
    return experiment


def _local_checkpoint(tmp_path: Path, step: int) -> ray.train.Checkpoint:
    directory = ckpt.save_checkpoint(
        tmp_path / f"local-{step}",
        model=nn.Linear(2, 1),
        train_state={"epoch": 0, "step": step},
        meta={"epoch": 0, "step": step},
    )
    return ray.train.Checkpoint.from_directory(str(directory))


def test_the_checkpoint_appears_complete_under_its_name(storage, tmp_path):
    name = ckpt.checkpoint_name(0, 10)
    persisted = upload_atomically(_local_checkpoint(tmp_path, 10), name)
    assert Path(persisted.path) == storage / name
    ckpt.verify_checkpoint(storage / name)
    assert sorted(p.name for p in storage.iterdir()) == [name]


def test_a_copy_killed_midway_leaves_only_a_partial_folder_that_is_never_used(
    storage, tmp_path, monkeypatch
):
    upload_atomically(_local_checkpoint(tmp_path, 10), ckpt.checkpoint_name(0, 10))
    real_copy_files = pyarrow.fs.copy_files

    def copy_one_file_then_die(source, destination, **kwargs):
        Path(destination, ckpt.MODEL_FILE).write_bytes(b"half")
        raise KeyboardInterrupt  # stands in for SIGKILL mid-copy

    monkeypatch.setattr(pyarrow.fs, "copy_files", copy_one_file_then_die)
    with pytest.raises(KeyboardInterrupt):
        upload_atomically(_local_checkpoint(tmp_path, 20), ckpt.checkpoint_name(0, 20))
    assert not (storage / ckpt.checkpoint_name(0, 20)).exists()
    assert (storage / (ckpt.checkpoint_name(0, 20) + ".partial")).exists()
    assert ckpt.checkpoints_newest_first(storage) == [storage / ckpt.checkpoint_name(0, 10)]

    monkeypatch.setattr(pyarrow.fs, "copy_files", real_copy_files)
    # The retried step replaces the leftover and lands complete.
    upload_atomically(_local_checkpoint(tmp_path, 21), ckpt.checkpoint_name(0, 20))
    ckpt.verify_checkpoint(storage / ckpt.checkpoint_name(0, 20))
    assert not (storage / (ckpt.checkpoint_name(0, 20) + ".partial")).exists()


def test_a_step_written_again_gets_a_new_name(storage, tmp_path):
    name = ckpt.checkpoint_name(1, 30)
    first = upload_atomically(_local_checkpoint(tmp_path, 30), name)
    second = upload_atomically(_local_checkpoint(tmp_path, 31), name)
    assert Path(second.path).name == f"{name}-r1" and first.path != second.path
    # the rewrite counts as the newer of the two
    assert ckpt.checkpoints_newest_first(storage)[0] == Path(second.path)


def _writes(step: int):
    """What the checkpoint writer hands ``save_atomically``: a function filling a folder."""

    def write(directory: Path) -> None:
        ckpt.save_checkpoint(
            directory,
            model=nn.Linear(2, 1),
            train_state={"epoch": 0, "step": step},
            meta={"epoch": 0, "step": step},
        )

    return write


def test_a_checkpoint_is_written_in_place_on_a_filesystem_and_never_copied(storage, monkeypatch):
    def no_copy(*args, **kwargs):
        raise AssertionError("a checkpoint on a filesystem was copied")

    monkeypatch.setattr(pyarrow.fs, "copy_files", no_copy)
    name = ckpt.checkpoint_name(0, 10)
    persisted = save_atomically(_writes(10), name)
    assert Path(persisted.path) == storage / name
    ckpt.verify_checkpoint(storage / name)
    assert sorted(p.name for p in storage.iterdir()) == [name]


def test_a_write_killed_midway_leaves_only_a_partial_folder_and_one_that_fails_nothing(storage):
    save_atomically(_writes(10), ckpt.checkpoint_name(0, 10))
    name = ckpt.checkpoint_name(0, 20)

    def killed_after_the_weights(directory: Path) -> None:
        (directory / ckpt.MODEL_FILE).write_bytes(b"half")
        raise KeyboardInterrupt  # stands in for SIGKILL mid-write: nothing runs after it

    with pytest.raises(KeyboardInterrupt):
        save_atomically(killed_after_the_weights, name)
    assert (storage / (name + ".partial")).exists() and not (storage / name).exists()
    assert ckpt.checkpoints_newest_first(storage) == [storage / ckpt.checkpoint_name(0, 10)]

    def disk_full(directory: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        save_atomically(disk_full, name)  # the leftover goes first; the failed one leaves none
    assert sorted(p.name for p in storage.iterdir()) == [ckpt.checkpoint_name(0, 10)]
    save_atomically(_writes(21), name)  # the retried step lands complete
    ckpt.verify_checkpoint(storage / name)


def test_a_listing_beside_a_save_in_flight_passes_over_what_vanishes(tmp_path, monkeypatch):
    """`raytrain predict` on a run that trains, or a test watching one, lists checkpoints
    while a save renames its `.partial` and the retention deletes an old one: the listing
    raised FileNotFoundError from the vanished directory (CI, test_lost_lease)."""
    for step in (5, 10, 20):
        ckpt.save_checkpoint(
            tmp_path / ckpt.checkpoint_name(0, step), model=nn.Linear(1, 1), train_state={}, meta={}
        )
    in_flight = tmp_path / (ckpt.checkpoint_name(0, 30) + ".partial")
    (in_flight / "shards").mkdir(parents=True)
    vanishing = {in_flight.name, ckpt.checkpoint_name(0, 5)}  # renamed, deleted meanwhile
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(os.fspath(path)).name in vanishing:
            raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert ckpt.checkpoints_newest_first(tmp_path) == [
        tmp_path / ckpt.checkpoint_name(0, 20),
        tmp_path / ckpt.checkpoint_name(0, 10),
    ]
