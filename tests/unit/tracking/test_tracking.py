"""Tracking (TensorBoard, MLflow, W&B, loss.png) and the plan lines, no Ray."""

from __future__ import annotations

import importlib.util
import json
import logging
import struct
import time
import zlib
from pathlib import Path

import pytest
from loop_harness import worker_task

from raytrain_app.checkpoint.ranking import SCORE_KEY, WORST_SCORE, UnknownMonitorError
from raytrain_app.cli import main
from raytrain_app.config import ConfigError, config_from_dict
from raytrain_app.tracking import trackers as tracking
from raytrain_app.tracking.loss_plot import loss_figure, write_loss_plot
from raytrain_app.tracking.tensorboard_tracker import read_tensorboard_scalars
from raytrain_app.tracking.trackers import open_tracker
from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.worker.session import InProcessSession


def _cfg(tmp_path: Path, **sections: dict):
    raw = {"experiment": {"name": "trk", "output_dir": str(tmp_path)}}
    return config_from_dict({**raw, **sections})


def _rows(epochs: int) -> list[dict]:
    return [
        {"epoch": e, "step": 10 * e, "train_loss": 1.0 / e, "val_loss": 1.5 / e, "lr": 1e-3}
        for e in range(1, epochs + 1)
    ]


# --------------------------------------------------------------------------- config


def test_tracking_keys_are_typed(tmp_path):
    with pytest.raises(ConfigError, match="tracking.log_every_steps"):
        _cfg(tmp_path, tracking={"log_every_steps": 0})
    with pytest.raises(ConfigError, match="tracking.tensorbord"):
        _cfg(tmp_path, tracking={"tensorbord": True})
    cfg = _cfg(tmp_path, tracking={"mlflow": True}, train={"mode": "max"})
    assert (cfg.tracking.tensorboard, cfg.tracking.mlflow, cfg.train.mode) == (True, True, "max")


# --------------------------------------------------------------------------- trackers


def test_tensorboard_event_files_hold_step_and_epoch_scalars(tmp_path):
    cfg = _cfg(tmp_path, tracking={"log_every_steps": 5})
    tracker = open_tracker(cfg, tmp_path, resumed_step=0, rank_zero=True)
    assert [tracker.due(step) for step in (4, 5, 10)] == [False, True, True]
    for step in (5, 10):
        tracker.log_step(step, {"loss": 1.0 / step, "lr": 0.01})
    for row in _rows(2):
        tracker.log_epoch(row["step"], row)
    tracker.close()
    scalars = read_tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["step/loss"] == {5: pytest.approx(0.2), 10: pytest.approx(0.1)}
    assert scalars["step/lr"] == {5: pytest.approx(0.01), 10: pytest.approx(0.01)}
    assert scalars["epoch/val_loss"] == {10: pytest.approx(1.5), 20: pytest.approx(0.75)}
    assert set(scalars) == {"step/loss", "step/lr"} | {
        f"epoch/{k}" for k in ("train_loss", "val_loss", "lr")
    }


def test_a_resumed_run_shows_every_step_once_in_tensorboard(tmp_path):
    """The second segment purges what the first logged after the checkpoint it resumes."""
    cfg = _cfg(tmp_path, tracking={"log_every_steps": 1})
    first = open_tracker(cfg, tmp_path, resumed_step=0, rank_zero=True)
    for step in range(1, 26):  # crashed at step 25, after the step-20 checkpoint
        first.log_step(step, {"loss": 1.0})
    first.log_epoch(10, _rows(1)[0])
    first.log_epoch(20, _rows(2)[1])
    first.close()
    time.sleep(1.05)  # event file names carry the second they were opened in
    second = open_tracker(cfg, tmp_path, resumed_step=20, rank_zero=True)
    for step in range(21, 31):
        second.log_step(step, {"loss": 2.0})
    second.log_epoch(30, _rows(3)[2])
    second.close()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # one file per segment
    scalars = read_tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["step/loss"] == {s: (1.0 if s <= 20 else 2.0) for s in range(1, 31)}
    assert sorted(scalars["epoch/val_loss"]) == [10, 20, 30]


def test_ranks_other_than_zero_and_disabled_tracking_write_nothing(tmp_path):
    tracker = open_tracker(_cfg(tmp_path), tmp_path, resumed_step=0, rank_zero=False)
    off = _cfg(tmp_path, tracking={"tensorboard": False})
    untracked = open_tracker(off, tmp_path, resumed_step=0, rank_zero=True)
    for t in (tracker, untracked):
        assert not t.due(10)
        t.log_step(10, {"loss": 1.0})
        t.log_epoch(10, _rows(1)[0])
        t.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_opens_its_writer_at_the_first_scalar_not_on_the_way_to_the_first_step(
    tmp_path,
):
    tracker = open_tracker(_cfg(tmp_path), tmp_path, resumed_step=0, rank_zero=True)
    assert not (tmp_path / "tensorboard").exists()
    tracker.log_epoch(10, _rows(1)[0])
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1
    tracker.close()


def test_a_failing_backend_is_switched_off_not_the_run(tmp_path, caplog):
    tracker = open_tracker(_cfg(tmp_path), tmp_path, resumed_step=0, rank_zero=True)
    (tmp_path / "tensorboard").write_text("a file where its folder goes")  # any error
    with caplog.at_level(logging.WARNING, logger="raytrain_app.tracking.trackers"):
        tracker.log_epoch(10, _rows(1)[0])
        tracker.log_epoch(20, _rows(2)[1])
    assert tracker.trackers == [] and len(caplog.records) == 1
    assert "TensorBoardTracker failed and is switched off" in caplog.text


def test_a_backend_that_cannot_start_is_left_out_with_a_warning(tmp_path, monkeypatch, caplog):
    def unreachable(*args):
        raise ConnectionError("mlflow.example: connection refused")

    monkeypatch.setattr(tracking, "MlflowTracker", unreachable)
    cfg = _cfg(tmp_path, tracking={"mlflow": True})
    with caplog.at_level(logging.WARNING, logger="raytrain_app.tracking.trackers"):
        tracker = open_tracker(cfg, tmp_path, resumed_step=0, rank_zero=True)
    assert [type(t).__name__ for t in tracker.trackers] == ["TensorBoardTracker"]
    assert "mlflow could not start" in caplog.text and "connection refused" in caplog.text
    tracker.close()


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="pip install '.[mlflow]'")
def test_mlflow_logs_to_a_file_store_in_the_run_directory_and_resumes_its_run(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = _cfg(tmp_path, tracking={"tensorboard": False, "mlflow": True, "log_every_steps": 5})
    first = open_tracker(cfg, tmp_path, resumed_step=0, rank_zero=True)
    first.log_step(5, {"loss": 0.5, "lr": 0.01})
    first.log_epoch(10, _rows(1)[0])
    first.close(failed=True)  # e.g. a crash; the resume continues the same MLflow run
    second = open_tracker(cfg, tmp_path, resumed_step=10, rank_zero=True)
    second.log_epoch(20, _rows(2)[1])
    second.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("trk").experiment_id])
    history = client.get_metric_history(run.info.run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(10, 1.5), (20, 0.75)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "step_loss")] == [5]
    assert run.data.params["train.lr"] == "0.001" and run.info.status == "FINISHED"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="pip install '.[wandb]'")
def test_wandb_logs_offline_into_the_run_directory(tmp_path):
    cfg = _cfg(tmp_path, tracking={"tensorboard": False, "wandb": True})
    tracker = open_tracker(cfg, tmp_path, resumed_step=0, rank_zero=True)
    tracker.log_step(10, {"loss": 0.123456789})
    tracker.log_epoch(10, _rows(1)[0])
    tracker.close()
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B's offline log holds each history item as its key and JSON value
    data = run_file.read_bytes()
    for key, value in (("step/loss", 0.123456789), ("epoch/val_loss", 1.5)):
        assert key.encode() in data and json.dumps(value).encode() in data, key
    ids = json.loads((tmp_path / ".tracking.json").read_text())
    assert ids["wandb"] in run_file.name  # a resume continues this run id


@pytest.mark.parametrize("command", ["train", "tune"])
@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_a_backend_that_is_not_installed_fails_before_ray_with_exit_code_2(
    backend, command, monkeypatch, capsys
):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == backend else real_find_spec(name, *a),
    )
    started = []
    monkeypatch.setattr("raytrain_app.driver.launch.ray_session", lambda *a: started.append(a))
    assert main([command, "--set", f"tracking.{backend}=true"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: tracking.{backend}=true needs the {backend} package; install it with pip "
        f"install 'raytrain_app[{backend}]' or set tracking.{backend}=false\n"
    )
    assert not started


# --------------------------------------------------------------------------- loss.png


def _png_chunks(path: Path) -> list[tuple[bytes, bytes]]:
    """Every chunk of a PNG file, its CRC checked."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = [], 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        offset += 12 + length
    return chunks


def test_loss_png_is_a_valid_png_of_every_epoch(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows(4)
    path = write_loss_plot(tmp_path, rows)
    assert path == tmp_path / "loss.png"
    chunks = _png_chunks(path)
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert (width, height) == (600, 400)
    text = dict(body.split(b"\0", 1) for kind, body in chunks if kind == b"tEXt")
    plotted = json.loads(text[b"Description"])
    assert plotted == {k: [row[k] for row in rows] for k in ("epoch", "train_loss", "val_loss")}
    figure = loss_figure(rows)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["val_loss"].get_xdata()) == [1, 2, 3, 4]
    assert list(lines["train_loss"].get_ydata()) == [row["train_loss"] for row in rows]


def test_without_matplotlib_a_note_says_how_to_get_the_plot(tmp_path, monkeypatch, caplog):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    with caplog.at_level(logging.INFO, logger="raytrain_app.tracking.loss_plot"):
        assert write_loss_plot(tmp_path, _rows(2)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "no loss.png: matplotlib is not installed; pip install 'raytrain_app[plot]' to get the "
        "loss plot (or set tracking.loss_plot=false)"
    ]
    assert not (tmp_path / "loss.png").exists()


# --------------------------------------------------------------------------- the worker loop


class _Session(InProcessSession):
    """One in-process worker of a given rank; keeps reports, no checkpoints on disk."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.world_rank = rank


def _task(tmp_path: Path, **train) -> WorkerTask:
    cfg = config_from_dict(
        {
            "experiment": {"name": "loop", "output_dir": str(tmp_path), "seed": 3},
            "model": {"target": "faults:build_model"},
            "data": {"target": "faults:build_data", "params": {"num_samples": 400}},
            "train": {"epochs": 2, "global_batch_size": 32, "checkpoint_every_steps": 4, **train},
            "scaling": {"num_workers": 1},
            "dataloader": {"num_workers": 0},
            "tracking": {"log_every_steps": 3},
        }
    )
    return worker_task(cfg, tmp_path / "loop", tmp_path / "data")


def test_rank_zero_tracks_and_reports_scores_that_rank_epochs_above_mid_epoch(tmp_path):
    session = _Session(rank=0)
    result = WorkerLoop(_task(tmp_path, mode="max"), session).run()
    history = result["history"]  # 320 train samples / 32 = 10 steps per epoch
    mid = [r for r in session.reports if r.get("mid_epoch")]
    ends = [r for r in session.reports if not r.get("mid_epoch")]
    assert [r["step"] for r in mid] == [4, 8, 12, 16]
    assert all(r[SCORE_KEY] == WORST_SCORE for r in mid)
    assert [r[SCORE_KEY] for r in ends] == [row["val_loss"] for row in history]  # mode max
    scalars = read_tensorboard_scalars(tmp_path / "loop" / "tensorboard")
    assert sorted(scalars["step/loss"]) == [3, 6, 9, 12, 15, 18]
    assert scalars["epoch/val_loss"] == {
        row["step"]: pytest.approx(row["val_loss"]) for row in history
    }


def test_the_loop_rejects_an_unknown_monitor_after_its_first_step(tmp_path):
    session = _Session(rank=0)
    with pytest.raises(UnknownMonitorError, match="train.monitor='val_mae'.*val_loss"):
        WorkerLoop(_task(tmp_path, monitor="val_mae"), session).run()
    assert session.reports == []


# --------------------------------------------------------------------------- plan


def test_plan_shows_the_checkpoint_policy_and_the_tracking_outputs(capsys):
    overrides = ["train.keep_checkpoints=3", "train.monitor=val_mae", "train.mode=max"]
    overrides += ["tracking.mlflow=true", "tracking.loss_plot=false"]
    assert main(["plan", *[arg for o in overrides for arg in ("--set", o)]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "checkpoints : keep the 3 best by val_mae (max) and always the newest; a resume "
        "continues from the newest"
    ) in lines
    assert "tracking    : metrics.csv (rank 0), tensorboard, mlflow" in lines
    assert main(["plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    policy = (plan["keep_checkpoints"], plan["monitor"], plan["monitor_mode"])
    assert policy == (2, "val_loss", "min")
    assert plan["tracking"] == ["tensorboard", "loss.png"]
