"""The SLURM script on a real private SLURM cluster (1 and 2 nodes in namespaces)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from paths import ROOT
from slurm_cluster import SlurmCluster, missing_requirements, start_cluster

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
]

SCRIPT = ROOT / "cluster" / "slurm" / "raytrain.sbatch"


def tiny_config(cluster: SlurmCluster, name: str, workers: int) -> Path:
    path = cluster.root / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "experiment": {"name": name, "output_dir": str(cluster.root / "runs")},
                "data": {"params": {"num_turbines": 2, "num_hours": 1200, "stride": 4}},
                "train": {"epochs": 1},
                "scaling": {"num_workers": workers},
            }
        )
    )
    return path


def summary(cluster: SlurmCluster, name: str) -> dict:
    return json.loads((cluster.root / "runs" / name / "summary.json").read_text())


def job_log(cluster: SlurmCluster, job_id: str) -> str:
    return (cluster.root / f"raytrain-{job_id}.out").read_text()


@pytest.fixture(scope="module")
def one_node():
    cluster = start_cluster(num_nodes=1, cpus=2)
    yield cluster
    cluster.stop()


def test_a_failing_training_fails_the_job(one_node):
    config = tiny_config(one_node, "broken", workers=2)
    job_id, code = one_node.sbatch_wait(
        ["--cpus-per-task=2", str(SCRIPT), "--config", str(config), "--set", "train.lrr=1"]
    )
    assert code != 0
    assert one_node.job_state(job_id) == "FAILED"
    log = job_log(one_node, job_id)
    assert "unknown config key 'train.lrr'" in log
    assert "Ray not started" in log and "Running command on head node" not in log


def test_a_training_job_and_a_sweep_job_share_a_node_without_colliding(one_node):
    """Two jobs at once on one node (1 CPU each): a training and, through the same script,
    a sweep."""
    train_config = tiny_config(one_node, "alone", workers=1)
    sweep_config = tiny_config(one_node, "sweep", workers=1)
    data = yaml.safe_load(sweep_config.read_text())
    data["tune"] = {
        "scheduler": "fifo",
        "num_samples": 1,
        "param_space": {"train.lr": {"grid": [1e-3, 2e-3]}},
    }
    sweep_config.write_text(yaml.safe_dump(data))
    ids = []
    for args in (["--config", str(train_config)], ["tune", "--config", str(sweep_config)]):
        result = one_node.run(
            ["sbatch", "--parsable", "--cpus-per-task=1", str(SCRIPT), *args], check=True
        )
        ids.append(result.stdout.strip())
    one_node.wait_for_jobs(ids)
    for job_id in ids:
        assert one_node.job_state(job_id) == "COMPLETED", job_log(one_node, job_id)
    assert summary(one_node, "alone")["world_size"] == 1
    run_dir = one_node.root / "runs" / "sweep"
    assert len((run_dir / "trials.csv").read_text().splitlines()) == 3
    assert (run_dir / "best_config.yaml").is_file()
    # Ray's ports came from the job ids, so the two jobs used different ones.
    heads = {re.search(r"head node1 \((\S+)\)", job_log(one_node, i)).group(1) for i in ids}
    assert len(heads) == 2, heads


def test_a_preempted_job_is_requeued_and_ends_like_an_uninterrupted_one(one_node):
    """SIGUSR1 (what --signal=B:USR1@120 sends before a time limit) mid-run: the training
    checkpoints at its next step and exits 75, the job is requeued and resumes there, from
    a run directory in a bucket; its checkpoint then serves predict and load_model."""
    s3 = one_node.start_s3("preempt")
    runs = s3.uri("runs")
    ids = {}
    for name in ("straight", "preempted"):
        config = tiny_config(one_node, name, workers=1)
        data = yaml.safe_load(config.read_text())
        data["experiment"]["output_dir"] = runs
        data["train"].update({"epochs": 4, "checkpoint_every_steps": 5})
        config.write_text(yaml.safe_dump(data))
        result = one_node.run(
            ["sbatch", "--parsable", "--cpus-per-task=1", str(SCRIPT), "--config", str(config)],
            check=True,
            env=s3.env(),
        )
        ids[name] = result.stdout.strip()
    deadline = time.monotonic() + 300
    while not [
        p
        for p in one_node.list_objects(s3, f"{runs}/preempted/checkpoints")
        if p.endswith("/manifest.json")
    ]:
        assert time.monotonic() < deadline, job_log(one_node, ids["preempted"])
        assert one_node.job_state(ids["preempted"]) in ("PENDING", "RUNNING")
        time.sleep(0.2)
    one_node.run(["scancel", "--signal=USR1", "--batch", ids["preempted"]], check=True)

    # A requeued job passes through REQUEUED and PENDING, which are not ended states.
    one_node.wait_for_jobs(list(ids.values()), timeout=deadline - time.monotonic())
    states = {i: one_node.job_state(i) for i in ids.values()}
    assert set(states.values()) == {"COMPLETED"}, states
    log = job_log(one_node, ids["preempted"])
    assert one_node.job_field(ids["preempted"], "Restarts") == "1", log
    assert "stopped on request (SIGUSR1)" in log and "requeued" in log
    assert "resumed from" in log
    preempted, straight = (
        json.loads(one_node.read_object(s3, f"{runs}/{name}/summary.json"))
        for name in ("preempted", "straight")
    )
    assert preempted["status"] == straight["status"] == "completed"
    # The uninterrupted job is the plain one-node case: the plan printed, no token leaked.
    straight_log = job_log(one_node, ids["straight"])
    assert "effective" in straight_log.split("Running command on head node")[1]
    assert "RAY_AUTH_TOKEN" not in straight_log
    assert "token" not in straight_log.lower().replace("token auth", "")
    for key, value in straight["final_metrics"].items():
        if key not in ("samples_per_s", "epoch_time_s"):
            assert preempted["final_metrics"][key] == value, key
    assert not (one_node.root / "runs" / "preempted").exists()  # all of it in the bucket

    # Inference straight from the bucket: the CLI, and load_model into a plain module.
    checkpoint = preempted["checkpoint"]
    assert checkpoint.startswith(f"{runs}/preempted/checkpoints/")
    output = one_node.root / "predictions.parquet"
    predicted = one_node.run(
        ["raytrain", "predict", "--checkpoint", checkpoint, "--output", str(output)],
        env=s3.env(),
    )
    assert predicted.returncode == 0 and output.is_file(), predicted.stderr
    loaded = one_node.run(
        [
            "python",
            "-c",
            "import sys, torch, raytrain_app as rt; m = rt.load_model(sys.argv[1]); "
            "print(type(m).__name__, isinstance(m, torch.nn.Module), "
            "next(m.parameters()).device)",
            checkpoint,
        ],
        env=s3.env(),
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split()[1:] == ["True", "cpu"], loaded.stdout
