"""Best and newest checkpoints: train.monitor / train.mode, scores, selection, no Ray."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.loading import find_checkpoint
from raytrain_app.checkpoint.ranking import (
    WORST_SCORE,
    UnknownMonitorError,
    best_checkpoint,
    check_monitor,
    check_monitor_on_one_batch,
    checkpoint_score,
)
from raytrain_app.config import ConfigError, config_from_dict
from raytrain_app.driver.training import TrainResult
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import ModelSpec, StepOutput


def _cfg(tmp_path: Path, **sections: dict):
    raw = {"experiment": {"name": "trk", "output_dir": str(tmp_path)}}
    return config_from_dict({**raw, **sections})


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("monitor", ["val_loss", "train_loss", "val_mae", "train_acc_top1"])
def test_monitor_accepts_epoch_metrics(tmp_path, monitor):
    assert _cfg(tmp_path, train={"monitor": monitor}).train.monitor == monitor


@pytest.mark.parametrize("monitor", ["loss", "lr", "val_", "epoch_time_s", "val loss"])
def test_monitor_rejects_other_names_in_one_line(tmp_path, monitor):
    with pytest.raises(ConfigError, match=r"train\.monitor.*train_loss, val_loss") as info:
        _cfg(tmp_path, train={"monitor": monitor})
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- monitor


def test_scores_rank_min_and_max_and_put_mid_epoch_last():
    assert checkpoint_score({"val_loss": 0.5}, "val_loss", "min") == -0.5
    assert checkpoint_score({"val_loss": 0.5}, "val_loss", "max") == 0.5
    for metrics in (
        {"epoch": 1, "step": 10, "mid_epoch": 1},
        {"val_loss": math.nan},
        {"val_loss": math.inf},
        {},
    ):
        assert checkpoint_score(metrics, "val_loss", "min") == WORST_SCORE
    # Ray persists scores as JSON, where NaN and infinities become null: keep them finite.
    assert math.isfinite(WORST_SCORE) and WORST_SCORE < -1e299


def test_an_unknown_monitor_names_the_key_and_the_available_metrics():
    check_monitor("val_mae", ["mae"])
    with pytest.raises(UnknownMonitorError) as info:
        check_monitor("val_acc", ["mae"])
    assert str(info.value) == (
        "train.monitor='val_acc' is not a metric this run reports; set train.monitor to one of "
        "train_loss, train_mae, val_loss, val_mae"
    )
    assert isinstance(info.value, BadInputError)  # exit code 2


def _spec(metrics: dict) -> ModelSpec:
    module = nn.Linear(2, 1)

    def step(model, batch):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return StepOutput(loss=loss, num_samples=len(y), metrics=metrics)

    return ModelSpec(module=module, step=step)


def test_the_driver_checks_the_monitor_on_one_batch():
    data = torch.utils.data.TensorDataset(torch.randn(5, 2), torch.randn(5, 1))
    check_monitor_on_one_batch("val_mae", _spec({"mae": torch.tensor(1.0)}), data)
    with pytest.raises(UnknownMonitorError, match="train.monitor='val_mae'.*val_loss"):
        check_monitor_on_one_batch("val_mae", _spec({}), data)

    def broken(model, batch):  # e.g. a GPU-only model: the workers check instead
        raise RuntimeError("no CUDA here")

    check_monitor_on_one_batch("val_mae", ModelSpec(module=nn.Linear(2, 1), step=broken), data)


def _saved(folder: Path, epoch: int, step: int, metrics: dict, mode: str = "min") -> Path:
    return ckpt.save_checkpoint(
        folder / ckpt.checkpoint_name(epoch, step),
        model=nn.Linear(1, 1),
        train_state={"epoch": epoch, "step": step},
        meta={
            "epoch": epoch,
            "step": step,
            "metrics": metrics,
            "config": {"train": {"monitor": "val_loss", "mode": mode}},
        },
    )


def test_the_best_checkpoint_of_a_run_is_chosen_by_monitor_and_mode(tmp_path):
    folder = tmp_path / "run" / "checkpoints" / "exp"
    first = _saved(folder, 1, 10, {"epoch": 1, "step": 10, "val_loss": 0.9})
    second = _saved(folder, 2, 20, {"epoch": 2, "step": 20, "val_loss": 0.4})
    third = _saved(folder, 3, 30, {"epoch": 3, "step": 30, "val_loss": 0.4})  # a tie: newer wins
    newest = _saved(folder, 3, 35, {"epoch": 3, "step": 35, "mid_epoch": 1})
    assert best_checkpoint(folder, "val_loss", "min").path == third
    best = best_checkpoint(folder, "val_loss", "max")
    assert (best.path, best.value, best.epoch) == (first, 0.9, 1)
    assert best.to_summary() == {"metric": "val_loss", "mode": "max", "value": 0.9, "epoch": 1}
    assert best_checkpoint(folder, "val_mae", "min") is None
    # A run directory means its best checkpoint (inference); the newest is for resuming.
    assert ckpt.checkpoints_newest_first(folder)[0] == newest
    assert find_checkpoint(tmp_path / "run") == third
    # A damaged best falls back to the newest intact checkpoint.
    (third / ckpt.MODEL_FILE).write_bytes(b"torn")
    assert find_checkpoint(tmp_path / "run") == newest
    assert second.is_dir()


def test_train_result_names_the_best_and_the_newest_checkpoint(tmp_path):
    result = TrainResult(
        run_dir=tmp_path,
        summary={"checkpoint": "/r/c/new", "best_checkpoint": "/r/c/best"},
    )
    assert (result.checkpoint, result.best_checkpoint) == (Path("/r/c/new"), Path("/r/c/best"))
    assert TrainResult(tmp_path, {"checkpoint": "/x"}).best_checkpoint is None
