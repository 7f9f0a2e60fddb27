"""Two SLURM nodes as separate as real ones (own CPU, own /tmp and /scratch, a shared
filesystem, an S3 server both reach), and raytrain on them: one worker per node planned
against the whole allocation, the run directory in a bucket, a node-local output_dir
refused before training."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import yaml
from paths import ROOT
from slurm_cluster import Node, SlurmCluster, missing_requirements, start_cluster

from raytrain_app.testing.processes import descendants, pids_naming

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
]

SCRIPT = ROOT / "cluster" / "slurm" / "raytrain.sbatch"
# The command: one task of one CPU on each of two nodes, two workers.
TWO_NODES = ["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1"]

ON_NODE1 = "srun --nodes=1 --ntasks=1 --nodelist=node1"
ON_NODE2 = "srun --nodes=1 --ntasks=1 --nodelist=node2"

# Job steps' probes, run from the shared directory.
PROBES = {
    "cpus.py": """
        import os, socket
        print("STEP", socket.gethostname(), ",".join(map(str, sorted(os.sched_getaffinity(0)))),
              os.environ["SLURM_JOB_CPUS_PER_NODE"], os.environ["SLURM_CPUS_ON_NODE"])
    """,
    "s3_put.py": """
        import sys
        from pyarrow import fs
        filesystem, path = fs.FileSystem.from_uri(sys.argv[1])
        with filesystem.open_output_stream(path) as out:
            out.write(sys.argv[2].encode())
    """,
    "s3_get.py": """
        import sys
        from pyarrow import fs
        filesystem, path = fs.FileSystem.from_uri(sys.argv[1])
        with filesystem.open_input_stream(path) as stream:
            print("GOT", stream.read().decode())
    """,
}


@pytest.fixture(scope="module")
def cluster():
    cluster = start_cluster(num_nodes=2, cpus=1)
    try:
        for name, code in PROBES.items():
            (cluster.shared / name).write_text(textwrap.dedent(code))
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def s3(cluster):
    """One S3 server on node 1 for the module's tests."""
    return cluster.start_s3("runs")


def batch(cluster: SlurmCluster, body: str, *sbatch_args: str, env=None) -> str:
    """Run ``body`` as a 2-node batch script; its output once it has COMPLETED."""
    name = f"job-{uuid.uuid4().hex[:8]}"
    script = cluster.shared / f"{name}.sh"
    script.write_text("#!/bin/bash\nset -euo pipefail\n" + textwrap.dedent(body))
    out = cluster.shared / f"{name}.out"
    submitted = cluster.run(
        ["sbatch", "--parsable", "--nodes=2", f"--output={out}", *sbatch_args, str(script)],
        check=True,
        env=env,
    )
    job_id = submitted.stdout.strip()
    cluster.wait_for_jobs([job_id], timeout=120)
    text = out.read_text()
    assert cluster.job_state(job_id) == "COMPLETED", text
    return text


def test_each_job_step_runs_on_its_own_nodes_cpu_only(cluster):
    out = batch(cluster, "srun python cpus.py\n", "--ntasks-per-node=1", "--cpus-per-task=1")
    steps = {line.split()[1]: line.split()[2:] for line in out.splitlines() if line[:4] == "STEP"}
    assert sorted(steps) == ["node1", "node2"], out
    for node in cluster.nodes:
        cores, job_cpus_per_node, cpus_on_node = steps[node.name]
        assert cores == ",".join(map(str, node.cores)) and len(node.cores) == 1
        assert (job_cpus_per_node, cpus_on_node) == ("1(x2)", "1")
    if len({core for node in cluster.nodes for core in node.cores}) == 2:  # 2+ host cores
        assert steps["node1"][0] != steps["node2"][0]


def test_tmp_and_scratch_are_node_local(cluster):
    name = f"rt-probe-{uuid.uuid4().hex}"
    out = batch(
        cluster,
        f"""\
        {ON_NODE2} bash -c 'echo node2 > /tmp/{name} && echo node2 > /scratch/{name}'
        {ON_NODE1} bash -c 'ls /tmp/{name} /scratch/{name} 2> /dev/null && echo SEEN; true'
        {ON_NODE2} bash -c 'cat /tmp/{name}'
        """,
    )
    assert "SEEN" not in out and out.splitlines() == ["node2"], out
    for directory in ("/tmp", "/scratch"):
        path = f"{directory}/{name}"
        assert cluster.node_path(1, path).read_text() == "node2\n"
        assert cluster.node_path(1, path).is_relative_to(cluster.shared / "nodes" / "node2")
        assert not cluster.node_path(0, path).exists()
        assert not Path(path).exists()  # nor on this machine's own disk


def test_the_shared_directory_is_common_to_every_node(cluster):
    path = cluster.shared / f"shared-{uuid.uuid4().hex}"
    out = batch(
        cluster,
        f"""\
        {ON_NODE2} bash -c 'echo written on node2 > {path}'
        {ON_NODE1} cat {path}
        """,
    )
    assert out.splitlines() == ["written on node2"], out
    assert cluster.node_path(0, path) == cluster.node_path(1, path) == path


def test_an_object_written_on_node2_is_read_on_node1_through_the_s3_server(cluster, s3):
    assert s3.endpoint_url.startswith(f"http://{cluster.nodes[0].address}:")
    uri = s3.uri("from-node2", "hello.txt")
    out = batch(
        cluster,
        f"""\
        {ON_NODE2} python s3_put.py {uri} 'hello from node2'
        {ON_NODE1} python s3_get.py {uri}
        """,
        env=s3.env(),
    )
    assert out.splitlines() == ["GOT hello from node2"], out


# --------------------------------------------------------------------------- raytrain


def train_config(cluster: SlurmCluster, name: str, output_dir: str) -> Path:
    """The quickstart's synthetic data and model, small, with two workers."""
    path = cluster.shared / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "experiment": {"name": name, "output_dir": output_dir},
                "data": {"params": {"num_turbines": 2, "num_hours": 1200, "stride": 4}},
                "train": {"epochs": 1},
            }
        )
    )
    return path


def test_two_nodes_train_one_worker_each_into_the_bucket_and_finish_on_one_when_one_is_lost(
    cluster, s3
):
    """An elastic run (scaling.num_workers=[1,2]) over two nodes of one CPU: one worker per
    node, planned against the whole allocation. The only storage the two nodes' workers
    share is the bucket: the synthetic data the driver prepares reaches node 2 through it,
    and the whole run directory lands there. After the first epoch node 2's Ray and its
    worker are SIGKILLed: the job completes on node 1 alone, as one worker."""
    config = train_config(cluster, "spread", s3.uri("runs"))
    data = yaml.safe_load(config.read_text())
    data["train"]["epochs"] = 4
    data["scaling"] = {"num_workers": [1, 2], "elastic_resize_interval_s": 3}
    config.write_text(yaml.safe_dump(data))
    env = {
        **s3.env(),
        # A lost node is declared dead in ~2 s (Ray's default is some 15-30 s), and a
        # worker group Ray cannot place is given up after 3 s instead of 60 (Ray Train then
        # decides the size again, from the nodes alive).
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_failure_threshold": "3",
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "3",
    }
    checkpoints = s3.uri("runs", "spread", "checkpoints")
    for attempt in (1, 2):
        submitted = cluster.run(
            ["sbatch", "--parsable", *TWO_NODES, str(SCRIPT), "--config", str(config)],
            check=True,
            env=env,
        )
        job_id = submitted.stdout.strip()
        log = cluster.shared / f"raytrain-{job_id}.out"
        if _first_checkpoint_written(cluster, s3, checkpoints, job_id, log, attempt):
            break

    lost = node_ray_processes(cluster.nodes[1], job_id)
    assert lost, "no Ray process of the job on node 2"
    for pid in lost:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cluster.wait_for_jobs([job_id], timeout=300)
    text = log.read_text()
    assert cluster.job_state(job_id) == "COMPLETED", text
    assert "plan: 2 worker(s) x micro-batch 32" in text
    assert "plan: 1 worker(s) x micro-batch 64" in text
    assert "Send termination request" not in text  # `ray stop`'s list, on either node
    summary = json.loads(cluster.read_object(s3, s3.uri("runs", "spread", "summary.json")))
    segments = [(s["step"], s["world_size"]) for s in summary["world_size_segments"]]
    assert [size for _, size in segments] == [2, 1] and segments[1][0] > 0, segments
    assert summary["status"] == "completed" and summary["epochs_completed"] == 4
    assert summary["world_size"] == 1 and summary["worker_nodes"] == ["10.77.0.1"]
    stored = cluster.list_objects(s3, s3.uri("runs", "spread"))
    for name in ("config.yaml", "metrics.csv", "summary.json", "loss.png"):
        assert name in stored, stored
    assert any(p.startswith("data/") and p.endswith(".parquet") for p in stored), stored
    assert any(p.endswith("/manifest.json") for p in stored if p.startswith("checkpoints/"))
    assert summary["checkpoint"].startswith("s3://runs/runs/spread/checkpoints/")
    # Nothing of the run on the shared filesystem or either node's disk.
    assert not list(cluster.shared.glob("**/spread/config.yaml"))
    assert not (cluster.shared / "s3:").exists()


def _first_checkpoint_written(cluster, s3, checkpoints, job_id, log, attempt) -> bool:
    """Wait until the first epoch's checkpoint is complete in the bucket (its manifest is
    put last), so the run continues from it. False only when the job's Ray never started
    on the first attempt: Ray gives a raylet a fixed 30 s to register, which the whole suite
    running beside this test on 2 cores has exceeded; the script then fails the job before
    anything is written (what this test is about starts after), and it is submitted again."""
    deadline = time.monotonic() + 240
    while not any(p.endswith("/manifest.json") for p in cluster.list_objects(s3, checkpoints)):
        state = cluster.job_state(job_id)
        if state not in ("PENDING", "RUNNING") and attempt == 1 and _log_says(log, _NEVER_STARTED):
            return False
        assert state in ("PENDING", "RUNNING"), log_text(log)
        assert time.monotonic() < deadline, log_text(log)
        time.sleep(0.5)
    return True


_NEVER_STARTED = "Ray did not start on every node"


def _log_says(log, text: str, within_s: float = 15.0) -> bool:
    """Whether the job's output file holds ``text``, read until ``within_s`` has passed:
    SLURM can report the job ended before the output file holds its last lines (seen in CI:
    state FAILED, the script's closing line in the file a moment later)."""
    deadline = time.monotonic() + within_s
    while text not in log_text(log):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_a_node_local_output_dir_is_refused_before_training(cluster):
    config = train_config(cluster, "scratch", "/scratch/runs")
    args = [*TWO_NODES, str(SCRIPT), "--config", str(config), "--set", "scaling.num_workers=2"]
    for attempt in (1, 2):
        job_id, code = cluster.sbatch_wait(args)
        log_path = cluster.shared / f"raytrain-{job_id}.out"
        # Submitted again only if node 2's Ray never started (as in the test above; seen in
        # CI: its raylet gives the dashboard agent a fixed 15 s to start, ray-project/ray
        # issue 65983): the refusal is decided once both nodes' Ray run.
        if code == 2 or attempt == 2 or not _log_says(log_path, _NEVER_STARTED):
            break
    log = log_path.read_text()
    assert code == 2, log
    assert (
        "experiment.output_dir '/scratch/runs' is not shared with node 10.77.0.2; use "
        "a path on a shared filesystem or an object-store URI such as s3://bucket/runs"
    ) in log
    assert "Traceback" not in log and "epoch 1/1" not in log
    for node in range(2):  # nothing written, on either node's disk
        assert not cluster.node_path(node, "/scratch/runs").exists()


def node_ray_processes(node: Node, job_id: str) -> set[int]:
    """Host PIDs of the job's Ray on ``node``: every process of the node naming the job's Ray
    temp dir (its symmetric-run, raylet, agents), and all they started (its workers)."""
    on_node = descendants(node.init_pid)
    named = {pid for pid in pids_naming(f"/rt-{job_id}") if pid in on_node}
    return named | {child for pid in named for child in descendants(pid)}


def log_text(log: Path) -> str:
    return log.read_text() if log.exists() else "(no log yet)"
