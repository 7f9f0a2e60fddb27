"""A sweep in the trackers: each Tune trial is one MLflow, W&B and TensorBoard run.

One small sweep (2 trials side by side, 2 epochs) with all three trackers on; each
backend's files are read back the way its own tools read them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import raytrain_app as rt
from raytrain_app.tracking.tensorboard_tracker import read_tensorboard_scalars
from raytrain_app.tracking.wandb_tracker import read_wandb_offline_run

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (importlib.util.find_spec("mlflow") and importlib.util.find_spec("wandb")),
        reason="pip install '.[mlflow,wandb]'",
    ),
]

EPOCHS = 2
EPOCH_METRICS = ("train_loss", "val_loss", "lr")


@pytest.fixture(scope="module")
def sweep(ray_cluster, tmp_path_factory):
    cfg = {
        "experiment": {"name": "tracked_sweep", "output_dir": str(tmp_path_factory.mktemp("st"))},
        "data": {"params": {"num_turbines": 2, "num_hours": 600, "stride": 4}},
        "model": {"params": {"d_model": 16, "dim_feedforward": 32}},
        "train": {"epochs": EPOCHS},
        "tracking": {"tensorboard": True, "mlflow": True, "wandb": True, "log_every_steps": 2},
        "tune": {
            "num_samples": 2,
            "max_concurrent_trials": 2,
            # ASHA stops every trial at its last report (max_t), as the default sweep does:
            # each closes its runs while Tune ends its process.
            "scheduler": "asha",
            "grace_period": EPOCHS,
            "param_space": {"train.lr": {"loguniform": [1.0e-4, 1.0e-2]}},
        },
    }
    result = rt.tune(cfg)
    assert (result.trials["status"] == "completed").all(), result.trials["error"].tolist()
    return result


def _sampled_lrs(sweep) -> dict[str, float]:
    """Each trial's sampled lr by trial id, from trials.csv."""
    return dict(zip(sweep.trials["trial_id"], sweep.trials["train.lr"], strict=True))


def test_mlflow_has_one_experiment_with_one_run_per_trial(sweep, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(sweep.run_dir / "mlruns").as_uri())
    experiments = [e for e in client.search_experiments() if e.name != "Default"]
    assert [e.name for e in experiments] == ["tracked_sweep"]
    runs = client.search_runs([experiments[0].experiment_id])
    by_name = {run.info.run_name: run for run in runs}
    assert len(runs) == 2 and len(by_name) == 2
    for trial_id, lr in _sampled_lrs(sweep).items():
        run = by_name[trial_id]  # the run is named after its trial
        assert float(run.data.params["train.lr"]) == pytest.approx(lr, rel=1e-12)
        assert run.info.status == "FINISHED"
        for metric in EPOCH_METRICS:
            history = client.get_metric_history(run.info.run_id, metric)
            assert len(history) == EPOCHS, metric


def test_wandb_has_one_offline_run_per_trial_in_the_sweeps_group(sweep):
    lrs = _sampled_lrs(sweep)
    runs = {}
    for trial_id in lrs:
        [run_file] = (sweep.run_dir / "trials" / trial_id / "wandb").glob(
            "offline-run-*/run-*.wandb"
        )
        runs[trial_id] = run = read_wandb_offline_run(run_file)
        assert (run.get("group"), run.get("name")) == ("tracked_sweep", trial_id), run_file
        assert run["config"]["train"]["lr"] == pytest.approx(lrs[trial_id], rel=1e-12)
        epochs = [row for row in run["history"] if "epoch/val_loss" in row]
        assert len(epochs) == EPOCHS
    assert len({run["id"] for run in runs.values()}) == 2


def _tensorboard_runs(logdir: Path) -> dict[str, dict[str, dict[int, float]]]:
    """What ``tensorboard --logdir`` shows: every folder holding event files is a run,
    named by its path under the logdir."""
    folders = {path.parent for path in logdir.rglob("events.out.tfevents.*")}
    return {str(f.relative_to(logdir)): read_tensorboard_scalars(f) for f in sorted(folders)}


def test_tensorboard_on_the_sweep_directory_shows_every_trial(sweep):
    runs = _tensorboard_runs(sweep.run_dir)
    for trial_id in _sampled_lrs(sweep):
        scalars = runs[f"trials/{trial_id}/tensorboard"]
        for metric in EPOCH_METRICS:
            assert len(scalars[f"epoch/{metric}"]) == EPOCHS, metric
        assert scalars["step/loss"]  # every tracking.log_every_steps steps
        lr = scalars["step/lr"]
        assert lr[min(lr)] <= _sampled_lrs(sweep)[trial_id] * (1 + 1e-6)
