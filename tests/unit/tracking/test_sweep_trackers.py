"""A sweep's trials in the trackers, no Ray: one MLflow experiment per sweep, a trial that
Tune pauses and resumes continues its own runs, a trial in a bucket keeps its tracking files
in its folder, and a trial that Tune stops is not a failed run.

``tests/distributed/test_sweep_tracking.py`` runs a real sweep with every tracker.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from loop_harness import worker_task

from raytrain_app.config import config_from_dict
from raytrain_app.storage import StorageLocation
from raytrain_app.testing.s3_server import s3_for_this_process
from raytrain_app.tracking.base import Tracker
from raytrain_app.tracking.run_files import RankZeroFiles
from raytrain_app.tracking.tensorboard_tracker import read_tensorboard_scalars
from raytrain_app.tracking.trackers import (
    IDS_FILE,
    SweepTrial,
    open_tracker,
    prepare_sweep_tracking,
)
from raytrain_app.worker import loop as worker_loop
from raytrain_app.worker.loop import WorkerLoop
from raytrain_app.worker.session import InProcessSession

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="pip install '.[mlflow]'"
)


def _trial_cfg(out: Path, lr: float, **tracking):
    return config_from_dict(
        {
            "experiment": {"name": "sw", "output_dir": str(out)},
            "train": {"lr": lr},
            "tracking": {"tensorboard": False, "mlflow": True, **tracking},
        }
    )


def _row(epoch: int) -> dict:
    return {"epoch": epoch, "step": 10 * epoch, "train_loss": 1.0 / epoch, "val_loss": 2.0 / epoch}


def _client(uri: str, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


@needs_mlflow
def test_trials_share_the_sweeps_experiment_and_a_resumed_trial_continues_its_run(
    tmp_path, monkeypatch
):
    sweep_dir = tmp_path / "sw"
    store = prepare_sweep_tracking(_trial_cfg(tmp_path, 1e-3), sweep_dir)
    # A resumed sweep prepares again: still one experiment.
    assert prepare_sweep_tracking(_trial_cfg(tmp_path, 1e-3), sweep_dir) == store
    assert store == (sweep_dir / "mlruns").as_uri()
    for trial_id, lr in (("a_00000", 1e-3), ("a_00001", 2e-3)):
        (sweep_dir / trial_id).mkdir(parents=True)
        trial = SweepTrial("sw", trial_id, store)
        tracker = open_tracker(_trial_cfg(tmp_path, lr), sweep_dir / trial_id, 0, True, trial)
        tracker.log_epoch(10, _row(1))
        tracker.close()  # a_00000: paused by PBT, or its sweep's driver died
    # Resumed in a fresh process: the ids kept in the trial's folder name its own run.
    resumed = SweepTrial("sw", "a_00000", store)
    tracker = open_tracker(_trial_cfg(tmp_path, 1e-3), sweep_dir / "a_00000", 10, True, resumed)
    tracker.log_epoch(20, _row(2))
    tracker.close()
    client = _client(store, monkeypatch)
    [experiment] = [e for e in client.search_experiments() if e.name != "Default"]
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert (experiment.name, sorted(runs)) == ("sw", ["a_00000", "a_00001"])
    assert runs["a_00001"].data.params["train.lr"] == "0.002"
    history = client.get_metric_history(runs["a_00000"].info.run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(10, 2.0), (20, 1.0)]
    assert runs["a_00000"].info.status == "FINISHED"
    ids = json.loads((sweep_dir / "a_00000" / IDS_FILE).read_text())
    assert ids["mlflow"] == runs["a_00000"].info.run_id


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server; this process's AWS_* variables point at it."""
    with s3_for_this_process("sweeps") as server:
        yield server


@needs_mlflow
def test_a_trial_of_a_sweep_in_a_bucket_keeps_its_tracking_files_in_its_folder(
    s3, tmp_path, monkeypatch
):
    cfg = _trial_cfg(s3.uri(), 1e-3, tensorboard=True)
    # MLflow writes no file store into a bucket: the trial keeps one in its folder.
    assert prepare_sweep_tracking(cfg, None) is None
    trial_dir = s3.uri("sw", "trials", "b_00000")
    for resumed_step, row in ((0, _row(1)), (10, _row(2))):  # the second on another node
        files = RankZeroFiles(trial_dir, rank_zero=True)
        trial = SweepTrial("sw", "b_00000")
        tracker = files.tracked(open_tracker(cfg, files.local, resumed_step, True, trial))
        tracker.log_epoch(row["step"], row)
        tracker.close()
    bucket = StorageLocation.parse(trial_dir, "experiment.output_dir")
    downloaded = tmp_path / "b_00000"
    bucket.download(downloaded)
    assert {IDS_FILE, "mlruns", "tensorboard"} <= {p.name for p in downloaded.iterdir()}
    scalars = read_tensorboard_scalars(downloaded / "tensorboard")
    assert sorted(scalars["epoch/val_loss"]) == [10, 20]
    client = _client((downloaded / "mlruns").as_uri(), monkeypatch)
    [run] = client.search_runs([client.get_experiment_by_name("sw").experiment_id])
    assert run.info.run_name == "b_00000"
    # One run over both segments (the second would have failed to find it, had the run's
    # empty folders, which the bucket does not keep, not been put back)...
    [run_dir] = (downloaded / "mlruns").glob(f"*/{run.info.run_id}")
    (run_dir / "artifacts").mkdir()  # ...as a reader of a downloaded copy must do too
    history = client.get_metric_history(run.info.run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(10, 2.0), (20, 1.0)]


class _Recording(Tracker):
    def __init__(self) -> None:
        self.closed: list[bool] = []

    def close(self, failed: bool = False) -> None:
        self.closed.append(failed)


class _StoppedAtFirstReport(InProcessSession):
    """Tune ending a trial at its report (ASHA stops it, PBT pauses it): ``exit(0)``."""

    def report(self, metrics, saved, name) -> None:
        raise SystemExit(0)


def test_a_trial_that_tune_stops_ends_its_runs_as_finished_not_failed(tmp_path, monkeypatch):
    recording = _Recording()
    monkeypatch.setattr(worker_loop, "open_tracker", lambda *args, **kwargs: recording)
    cfg = config_from_dict(
        {
            "experiment": {"name": "stopped", "output_dir": str(tmp_path)},
            "model": {"target": "faults:build_model"},
            "data": {"target": "faults:build_data", "params": {"num_samples": 200}},
            "train": {"epochs": 2, "global_batch_size": 32},
            "scaling": {"num_workers": 1},
            "dataloader": {"num_workers": 0},
        }
    )
    task = worker_task(cfg, tmp_path / "trial", tmp_path / "data")
    with pytest.raises(SystemExit):
        WorkerLoop(task, _StoppedAtFirstReport()).run()
    assert recording.closed == [False]
