"""A run directory in an object store (``s3://``) on a real Ray, against a real S3 protocol
server: the whole run lives in the bucket, nothing is written locally, runs resume from
there, and models, predictions, data and sweeps all go through it."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from torch import nn

import raytrain_app as rt
from raytrain_app.checkpoint.store import MODEL_FILE
from raytrain_app.data import synthetic_wind
from raytrain_app.errors import BadInputError
from raytrain_app.storage import StorageLocation
from raytrain_app.testing.processes import wait_until_gone
from raytrain_app.testing.s3_server import s3_for_this_process

pytestmark = pytest.mark.distributed

EPOCHS = 2
BUCKET = "raytrain-runs"


@pytest.fixture(scope="module")
def s3(ray_cluster, tmp_path_factory):
    """A moto S3 server; the AWS_* variables point this process at it.

    The session's Ray started before they were set, so its workers see them only if the
    driver forwards them, as it must for a running cluster.
    """
    with s3_for_this_process(BUCKET, log_path=tmp_path_factory.mktemp("s3") / "moto.log") as server:
        yield server


def config(output_dir: str, name: str, workers: int = 2, **sections) -> dict:
    """A small run (as test_train.py's) that writes TensorBoard files too."""
    return {
        "experiment": {"name": name, "output_dir": output_dir, "seed": 0},
        "data": {"params": {"num_turbines": 2, "num_hours": 1200, "stride": 4}},
        "model": {"params": {"d_model": 16, "dim_feedforward": 32, "dropout": 0.0}},
        "train": {"epochs": EPOCHS, "global_batch_size": 64},
        "scaling": {"num_workers": workers},
        "fault_tolerance": {"max_failures": 0},
        "tracking": {"tensorboard": True},
        **sections,
    }


def keys(s3, *prefix: str) -> list[str]:
    """Every object under ``s3://bucket/<prefix>``, relative to it."""
    location = StorageLocation.parse(s3.uri(*prefix), "test")
    return [item.path[len(location.path) + 1 :] for item in location.list_dir(True, True)]


def read(s3, *parts: str) -> str:
    return StorageLocation.parse(s3.uri(*parts), "test").read_text()


@pytest.fixture(scope="module")
def bucket_run(s3, tmp_path_factory):
    """A 2-worker run into the bucket, from a working directory that must stay empty."""
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        result = rt.train(config(s3.uri("runs"), "remote"), progress=False)
    return result, cwd


def test_the_whole_run_directory_is_in_the_bucket_and_nothing_local(s3, bucket_run):
    result, cwd = bucket_run
    assert result.run_dir == s3.uri("runs", "remote")
    assert list(cwd.iterdir()) == []  # no "s3:" folder, nothing else
    stored = keys(s3, "runs", "remote")
    for name in ("config.yaml", "metrics.csv", "summary.json", "loss.png"):
        assert name in stored, stored
    assert any(k.startswith("tensorboard/events.out.tfevents.") for k in stored), stored
    assert any(k.startswith("data/synthetic_wind-") for k in stored), stored
    assert any(k.startswith("checkpoints/") and k.endswith(MODEL_FILE) for k in stored)
    summary = json.loads(read(s3, "runs", "remote", "summary.json"))
    assert summary["checkpoint"].startswith(s3.uri("runs", "remote", "checkpoints") + "/")
    assert summary["best_checkpoint"].startswith(s3.uri("runs", "remote", "checkpoints") + "/")
    assert result.checkpoint == summary["checkpoint"]
    assert [row["epoch"] for row in result.metrics] == list(range(1, EPOCHS + 1))
    assert len(read(s3, "runs", "remote", "metrics.csv").strip().splitlines()) == EPOCHS + 1


def test_the_same_name_resumes_from_the_bucket_and_a_changed_config_is_refused(s3, bucket_run):
    first, _ = bucket_run
    again = rt.train(config(s3.uri("runs"), "remote"), progress=False)
    assert again.metrics == first.metrics  # continued from its last checkpoint: no epoch redone
    assert again.summary["final_metrics"] == first.summary["final_metrics"]
    changed = config(s3.uri("runs"), "remote", train={"epochs": EPOCHS, "lr": 3e-3})
    with pytest.raises(BadInputError, match=r"'remote' already holds a run.*train.lr"):
        rt.train(changed, progress=False)


def test_load_model_from_the_bucket_is_a_plain_module_with_the_checkpoints_weights(s3, bucket_run):
    result, _ = bucket_run
    model = rt.load_model(result.checkpoint, weights="raw")
    assert type(model) is not nn.parallel.DistributedDataParallel and isinstance(model, nn.Module)
    assert {p.device.type for p in model.parameters()} == {"cpu"} and not model.training
    stored = StorageLocation.parse(f"{result.checkpoint}/{MODEL_FILE}", "t").read_bytes()
    weights = torch.load(io.BytesIO(stored), map_location="cpu", weights_only=True)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[key]), key
    # A run directory's URI loads its best checkpoint.
    best = rt.load_model(result.run_dir)
    assert best.state_dict().keys() == model.state_dict().keys()


def test_predict_cli_reads_a_checkpoint_in_the_bucket(s3, bucket_run, tmp_path):
    result, _ = bucket_run
    output = tmp_path / "predictions.parquet"
    command = [sys.executable, "-m", "raytrain_app.cli", "predict"]
    command += ["--checkpoint", result.run_dir, "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    table = pq.read_table(output)
    assert table.num_rows > 0 and "pred_0" in table.column_names


def test_parquet_data_in_the_bucket_trains(s3, tmp_path):
    local = synthetic_wind.materialize(tmp_path, num_turbines=2, num_hours=1200, seed=0)
    StorageLocation.parse(s3.uri("datasets", "wind", local.name), "t").upload(local)
    data = {
        "path": s3.uri("datasets", "wind", "*.parquet"),
        "params": {
            "feature_columns": list(synthetic_wind.FEATURE_COLUMNS),
            "target_column": synthetic_wind.TARGET_COLUMN,
            "group_column": synthetic_wind.GROUP_COLUMN,
            "time_column": synthetic_wind.TIME_COLUMN,
            "stride": 4,
        },
    }
    cfg = config(str(tmp_path / "runs"), "bucket-data", workers=1, data=data)
    cfg["train"]["epochs"] = 1
    result = rt.train(cfg, progress=False)
    assert [row["epoch"] for row in result.metrics] == [1]
    assert (result.run_dir / "summary.json").is_file()


def test_a_sweep_in_the_bucket_resumes_after_ctrl_c_and_after_its_driver_is_killed(
    s3, tmp_path, ray_tmp
):
    """`raytrain tune` interrupted twice: Ctrl-C (exit 130, saying how to resume), then,
    resumed, SIGKILLed (no clean-up at all); the same command then finishes the sweep from
    the bucket and writes its results there. Tune unpickles its saved state, so a resume
    from a bucket needs --trust-code: without it, one line and exit 2, the state untouched."""
    cfg = config(s3.uri("sweeps"), "small", workers=1)
    cfg["tracking"] = {"tensorboard": False}
    cfg["tune"] = {
        # Two trials, one at a time: each interruption lands once one more has metrics.
        "num_samples": 2,
        "max_concurrent_trials": 1,
        "scheduler": "fifo",
        "param_space": {"train.lr": {"loguniform": [1.0e-3, 3.0e-3]}},
    }
    config_file = tmp_path / "sweep.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    untrusted = [sys.executable, "-m", "raytrain_app.cli", "tune", "--config", str(config_file)]
    command = [*untrusted, "--trust-code"]
    # The CLI's own embedded Ray; the AWS_* variables of this process (the s3 fixture) too.
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": ray_tmp}

    def interrupted(how: signal.Signals) -> tuple[int, str]:
        """Run the sweep until one more trial has written metrics, then send ``how``."""
        written = len(
            [k for k in keys(s3, "sweeps", "small", "trials") if k.endswith("/metrics.csv")]
        )
        with subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            deadline = time.monotonic() + 180
            while (
                len(
                    [k for k in keys(s3, "sweeps", "small", "trials") if k.endswith("/metrics.csv")]
                )
                <= written
            ):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.5)
            proc.send_signal(how)
            output, _ = proc.communicate(timeout=120)
        return proc.returncode, output

    code, output = interrupted(signal.SIGINT)
    assert code == 130, output
    assert "run the same command again to resume" in output

    state_before = set(keys(s3, "sweeps", "small", "tune"))
    refused = subprocess.run(untrusted, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "would unpickle Tune's saved state" in refused.stderr, refused.stderr
    assert "--trust-code" in refused.stderr and "Traceback" not in refused.stderr
    assert set(keys(s3, "sweeps", "small", "tune")) == state_before

    code, output = interrupted(signal.SIGKILL)
    assert code == -signal.SIGKILL, output
    assert "resuming the sweep" in output
    assert not wait_until_gone(ray_tmp, timeout_s=60), "Ray outlived its SIGKILLed driver"

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resuming the sweep" in rerun.stdout + rerun.stderr
    stored = keys(s3, "sweeps", "small")
    assert {"config.yaml", "trials.csv", "best_config.yaml"} <= set(stored), stored
    trials = read(s3, "sweeps", "small", "trials.csv").strip().splitlines()
    # FIFO stops nothing early: every trial, the interrupted one too, ran all its epochs.
    assert len(trials) == 3 and all(row.endswith(f",{EPOCHS},completed,") for row in trials[1:])
    for row in trials[1:]:
        assert f"trials/{row.split(',')[0]}/metrics.csv" in stored, stored
