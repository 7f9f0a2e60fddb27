"""Best and newest checkpoints, tracking and loss.png on a real Ray with 2 gloo workers.

One run does it all: ``train.mode=max`` on ``val_loss`` makes an early epoch the best
(validation loss falls), rank 1 is killed mid-epoch 3 so Ray restarts the workers from
the newest checkpoint, a mid-epoch one that no ranking keeps, and every tracker writes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import raytrain_app as rt
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.loading import find_checkpoint
from raytrain_app.errors import BadInputError
from raytrain_app.tracking.tensorboard_tracker import read_tensorboard_scalars

pytestmark = pytest.mark.distributed

EPOCHS = 4
STEPS_PER_EPOCH = 25  # 801 train samples / global batch 32
KILL_AT_STEP = 65  # mid-epoch 3, 5 steps after the step-60 checkpoint
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


def tracked_config(output_dir: Path, name: str, **model_params) -> dict:
    return {
        "experiment": {"name": name, "output_dir": str(output_dir), "seed": 5},
        "model": {"target": "paused_faults:build_model", "params": model_params},
        "data": {"target": "paused_faults:build_data", "params": {"num_samples": 1002}},
        "train": {
            "epochs": EPOCHS,
            "global_batch_size": 32,
            "lr": 0.01,
            "checkpoint_every_steps": 10,
            "keep_checkpoints": 2,
            "mode": "max",  # the worst validation loss is "best": an early epoch
        },
        "scaling": {"num_workers": 2},
        "dataloader": {"num_workers": 0},
        "fault_tolerance": {"max_failures": 1},
        "tracking": {"log_every_steps": 5, "mlflow": HAS_MLFLOW},
    }


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("tracked")
    marker = out / "killed"
    cfg = tracked_config(
        out,
        "tracked",
        kill_rank=1,
        kill_at_call=KILL_AT_STEP,
        marker=str(marker),
        # where Ray keeps its checkpoint bookkeeping: the kill waits until it has step 60
        checkpoints_dir=str(out / "tracked" / "checkpoints" / "tracked"),
        await_step=60,
    )
    result = rt.train(cfg, progress=False)
    assert marker.exists(), "the worker was never killed"
    return result


def _epoch_of(directory: Path) -> tuple[int, int]:
    meta = ckpt.read_meta(directory)
    return meta["epoch"], meta["step"]


def test_the_best_checkpoint_survives_next_to_the_newest(run):
    rows = run.metrics
    assert [row["epoch"] for row in rows] == list(range(1, EPOCHS + 1))
    by_val = sorted(rows, key=lambda row: row["val_loss"], reverse=True)  # mode max
    best_epoch = by_val[0]["epoch"]
    assert best_epoch != EPOCHS, "the test needs a best epoch that is not the last"
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["best_metric"] == {
        "metric": "val_loss",
        "mode": "max",
        "value": by_val[0]["val_loss"],
        "epoch": best_epoch,
    }
    best, newest = Path(summary["best_checkpoint"]), Path(summary["checkpoint"])
    assert run.best_checkpoint == best and run.checkpoint == newest
    assert _epoch_of(best) == (best_epoch, best_epoch * STEPS_PER_EPOCH)
    assert _epoch_of(newest) == (EPOCHS, EPOCHS * STEPS_PER_EPOCH)
    # Ray kept the 2 best epochs by the monitor, and the newest besides.
    kept = {_epoch_of(d) for d in ckpt.checkpoints_newest_first(run.run_dir / "checkpoints")}
    expected = {(row["epoch"], row["epoch"] * STEPS_PER_EPOCH) for row in by_val[:2]}
    assert kept == expected | {(EPOCHS, EPOCHS * STEPS_PER_EPOCH)}
    # Inference from the run directory takes the best checkpoint.
    assert find_checkpoint(run.run_dir) == best
    rt.load_model(run.run_dir, trust_code=True)


def test_the_restart_resumed_from_the_newest_mid_epoch_checkpoint(run):
    """Ray handed back the step-60 checkpoint, ranked below every epoch but never deleted
    while newest: the second TensorBoard segment starts (purges) right after it."""
    logdir = run.run_dir / "tensorboard"
    files = sorted(logdir.iterdir())
    # one event file per run segment, from rank 0 only (2 workers would make 4)
    assert [f.name.rsplit(".", 1)[1] for f in files] == ["step0", "step60"]
    scalars = read_tensorboard_scalars(logdir)
    assert sorted(scalars["step/loss"]) == list(range(5, EPOCHS * STEPS_PER_EPOCH + 1, 5))
    assert scalars["epoch/val_loss"] == {
        row["step"]: pytest.approx(row["val_loss"], rel=1e-6) for row in run.metrics
    }
    assert json.loads((run.run_dir / "summary.json").read_text())["status"] == "completed"


def test_only_rank_zero_wrote_the_tracking_files(run):
    top = {p.name for p in run.run_dir.iterdir()}
    expected = {"config.yaml", "metrics.csv", "summary.json", "loss.png", "checkpoints"}
    expected |= {"tensorboard"} | ({"mlruns", ".tracking.json"} if HAS_MLFLOW else set())
    assert top == expected
    assert (run.run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not HAS_MLFLOW, reason="pip install '.[mlflow]'")
def test_mlflow_continues_one_run_across_the_restart(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads file stores on request
    client = MlflowClient(tracking_uri=(run.run_dir / "mlruns").as_uri())
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    history = client.get_metric_history(mlflow_run.info.run_id, "val_loss")
    assert [m.step for m in history] == [row["step"] for row in run.metrics]
    assert mlflow_run.info.status == "FINISHED"


def test_an_unknown_monitor_fails_before_training_naming_the_metrics(ray_cluster, tmp_path):
    cfg = tracked_config(tmp_path, "bad-monitor", marker=str(tmp_path / "unused"))
    cfg["train"]["monitor"] = "val_mae"
    with pytest.raises(BadInputError) as info:
        rt.train(cfg, progress=False)
    assert str(info.value) == (
        "train.monitor='val_mae' is not a metric this run reports; set train.monitor to one "
        "of train_loss, val_loss"
    )
    assert not (tmp_path / "bad-monitor" / "config.yaml").exists()
