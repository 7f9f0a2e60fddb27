"""The SLURM script on a real private SLURM cluster (1 and 2 nodes in namespaces)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from fault_runs import TIMING_COLUMNS, fault_config
from paths import EXAMPLES, ROOT, TEST_WORKLOADS
from slurm_cluster import SlurmCluster, missing_requirements, start_cluster

import raytrain_app as rt

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
]

SCRIPT = ROOT / "cluster" / "slurm" / "raytrain.sbatch"
# What the jobs' workers import for the faults workload, as a user's PYTHONPATH would.
WORKLOADS = f"{TEST_WORKLOADS}:{EXAMPLES}"


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
        log = job_log(one_node, job_id)
        assert one_node.job_state(job_id) == "COMPLETED", log
        # Ray's closing `ray stop` lists each process it stops, command line and all, when
        # its output is no terminal: the script leaves those lines out of the job's log.
        assert "Send termination request" not in log and "raylet --raylet_socket" not in log
    assert "run directory :" in job_log(one_node, ids[0])  # the run's own output passes
    assert summary(one_node, "alone")["world_size"] == 1
    run_dir = one_node.root / "runs" / "sweep"
    assert len((run_dir / "trials.csv").read_text().splitlines()) == 3
    assert (run_dir / "best_config.yaml").is_file()
    # Ray's ports came from the job ids, so the two jobs used different ones.
    heads = {re.search(r"head node1 \((\S+)\)", job_log(one_node, i)).group(1) for i in ids}
    assert len(heads) == 2, heads


def test_a_preempted_job_is_requeued_and_ends_like_an_uninterrupted_one(one_node, fault_reference):
    """SIGUSR1 (what --signal=B:USR1@120 sends before a time limit) mid-run: the training
    checkpoints at its next step and exits 75, the job is requeued and resumes there, from
    a run directory in a bucket, and ends bit for bit as the session's uninterrupted run of
    the same config (2 workers); its checkpoint then loads into a plain module."""
    s3 = one_node.start_s3("preempt")
    runs = s3.uri("runs")
    # 30 ms per micro-batch (the numbers are the same): time to preempt it mid-run.
    cfg = fault_config(runs, "preempted", sleep_s=0.03)
    config = one_node.root / "preempted.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**s3.env(), "PYTHONPATH": WORKLOADS}
    result = one_node.run(
        ["sbatch", "--parsable", "--cpus-per-task=2", str(SCRIPT), "--config", str(config)],
        check=True,
        env=env,
    )
    job_id = result.stdout.strip()
    deadline = time.monotonic() + 300
    while not [
        p
        for p in one_node.list_objects(s3, f"{runs}/preempted/checkpoints")
        if p.endswith("/manifest.json")
    ]:
        assert time.monotonic() < deadline, job_log(one_node, job_id)
        assert one_node.job_state(job_id) in ("PENDING", "RUNNING")
        time.sleep(0.2)
    one_node.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)

    # A requeued job passes through REQUEUED and PENDING, which are not ended states. Its
    # own bound, not what the first checkpoint left of the first: a CI run beside other
    # work saw the requeued job still running 178 s later; alone the test passed.
    one_node.wait_for_jobs([job_id], timeout=300)
    log = job_log(one_node, job_id)
    assert one_node.job_state(job_id) == "COMPLETED", log
    assert one_node.job_field(job_id, "Restarts") == "1", log
    assert "stopped on request (SIGUSR1)" in log and "requeued" in log
    assert "resumed from" in log
    # The plan printed on the head, no token leaked.
    assert "effective" in log.split("Running command on head node")[1]
    assert "RAY_AUTH_TOKEN" not in log
    assert "token" not in log.lower().replace("token auth", "")
    summary = json.loads(one_node.read_object(s3, f"{runs}/preempted/summary.json"))
    assert summary["status"] == "completed"
    expected = fault_reference.metrics[-1]
    for key, value in expected.items():
        if key not in TIMING_COLUMNS:
            assert summary["final_metrics"][key] == value, key
    assert not (one_node.root / "runs" / "preempted").exists()  # all of it in the bucket

    # load_model straight from the bucket, on the node: a plain module whose weights are the
    # uninterrupted run's (predict from a bucket: tests/distributed/test_object_store.py).
    checkpoint = summary["checkpoint"]
    assert checkpoint.startswith(f"{runs}/preempted/checkpoints/")
    weights = one_node.root / "weights.pt"
    loaded = one_node.run(
        [
            "python",
            "-c",
            "import sys, torch, raytrain_app as rt; "
            "m = rt.load_model(sys.argv[1], trust_code=True); "
            "print(type(m).__name__, isinstance(m, torch.nn.Module), "
            "next(m.parameters()).device); torch.save(m.state_dict(), sys.argv[2])",
            checkpoint,
            str(weights),
        ],
        env=env,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split()[1:] == ["True", "cpu"], loaded.stdout
    ours = torch.load(weights, weights_only=True)
    for key, tensor in rt.load_model(fault_reference.run_dir, trust_code=True).state_dict().items():
        assert torch.equal(ours[key], tensor), key
