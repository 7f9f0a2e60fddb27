"""Checkpoints Ray never recorded (a save that finished after its attempt failed, a write
killed mid-way) are removed at the run's end as Ray's retention would have removed them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from raytrain_app.driver.checkpoint_sweep import remove_unrecorded_checkpoints
from raytrain_app.storage import StorageLocation

MID_EPOCH = {"epoch": 2, "step": 60, "mid_epoch": 1}


def _checkpoint(folder: Path, epoch: int, step: int, metrics: dict) -> Path:
    directory = folder / f"checkpoint_epoch{epoch}_step{step}"
    directory.mkdir(parents=True)
    (directory / "meta.json").write_text(json.dumps({"metrics": metrics}))
    return directory


def _ray_result(newest: Path, *kept: Path) -> SimpleNamespace:
    """What Ray's Result says: its newest checkpoint and those its retention kept."""
    checkpoint = SimpleNamespace(path=str(newest))
    best = [(SimpleNamespace(path=str(path)), {}) for path in (*kept, newest)]
    return SimpleNamespace(checkpoint=checkpoint, best_checkpoints=best)


def _run(tmp_path: Path) -> tuple[Path, SimpleNamespace]:
    """keep_checkpoints 2 by val_loss (min): Ray kept epochs 1 and 2, and the newest."""
    folder = tmp_path / "checkpoints" / "run"
    epoch1 = _checkpoint(folder, 1, 25, {"epoch": 1, "val_loss": 0.5})
    epoch2 = _checkpoint(folder, 2, 50, {"epoch": 2, "val_loss": 0.4})
    newest = _checkpoint(folder, 4, 100, {"epoch": 4, "val_loss": 0.6})
    return folder, _ray_result(newest, epoch1, epoch2)


def test_an_unrecorded_mid_epoch_checkpoint_and_a_torn_write_are_removed(tmp_path):
    folder, result = _run(tmp_path)
    _checkpoint(folder, 2, 60, MID_EPOCH)  # finished after its attempt failed
    (folder / "checkpoint_epoch3_step80.partial").mkdir()  # its writer was killed
    checkpoints = StorageLocation.local(tmp_path / "checkpoints")

    removed = remove_unrecorded_checkpoints(checkpoints, result, 2, "val_loss", "min")

    assert removed == ["checkpoint_epoch2_step60", "checkpoint_epoch3_step80.partial"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "checkpoint_epoch1_step25",
        "checkpoint_epoch2_step50",
        "checkpoint_epoch4_step100",
    ]


def test_what_ray_would_have_kept_stays(tmp_path):
    folder, result = _run(tmp_path)
    # an epoch's checkpoint Ray might have ranked among the best: not the driver's to drop
    _checkpoint(folder, 3, 75, {"epoch": 3, "val_loss": 0.1})
    checkpoints = StorageLocation.local(tmp_path / "checkpoints")
    assert remove_unrecorded_checkpoints(checkpoints, result, 2, "val_loss", "min") == []
    # keep_checkpoints unset: Ray keeps every checkpoint, so the unrecorded one stays too
    _checkpoint(folder, 2, 60, MID_EPOCH)
    assert remove_unrecorded_checkpoints(checkpoints, result, None, "val_loss", "min") == []
    # newer than Ray's newest (a driver killed before Ray recorded it): the next resume's
    _checkpoint(folder, 4, 110, {"epoch": 4, "step": 110, "mid_epoch": 1})
    assert remove_unrecorded_checkpoints(checkpoints, result, 2, "val_loss", "min") == [
        "checkpoint_epoch2_step60"
    ]
    assert (folder / "checkpoint_epoch4_step110").is_dir()


def test_a_run_without_a_checkpoint_removes_nothing(tmp_path):
    checkpoints = StorageLocation.local(tmp_path / "checkpoints")
    result = SimpleNamespace(checkpoint=None, best_checkpoints=[])
    assert remove_unrecorded_checkpoints(checkpoints, result, 2, "val_loss", "min") == []
