"""Elastic training (``scaling.num_workers: [1, 2]``) on a real Ray cluster whose second
node is lost and later replaced: the run goes on with one worker, grows back to two, and
ends where an uninterrupted two-worker run ends, because every size trains the same global
batch on the same samples per optimizer step.

The data streams (``data.streaming: true``: Parquet prepared once, read by lanes): its
order is the one that must survive the resizes. Data in memory keeps the same promise
through its sampler, checked across world sizes in
tests/unit/worker/test_resume_other_world_size.py."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from fault_runs import assert_close_to, fault_config
from loop_harness import LocalSession, run_loop, worker_task
from paths import ROOT
from stream_data import prepare_here

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.config import config_from_dict
from raytrain_app.testing.ray_head import RayHead, RayNode, join_node, start_head
from raytrain_app.tracking.metrics_log import read_metrics

pytestmark = pytest.mark.cluster

# What the cluster's workers import: the fault workload and the sine data it builds on.
WORKLOADS = f"{ROOT / 'tests' / 'support' / 'workloads'}:{ROOT / 'examples'}"
STEPS = 200  # 4 epochs of 50 optimizer steps (fault_config)
# Ray Train waits this long for a worker group it cannot place before it decides again
# (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s by default). Right after a node is lost
# Ray may still count it, and the first restart waits for its worker in vain.
START_TIMEOUT_S = "3"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head and one more node, one CPU each; a silent node is declared dead in ~2 s."""
    head = start_head(tmp_path_factory.mktemp("elastic"), 1, pythonpath=WORKLOADS, node_death_s=2)
    nodes = [join_node(head, pythonpath=WORKLOADS)]
    yield head, nodes
    for node in nodes:
        node.stop()
    head.stop()


def train_command(head: RayHead, config: Path, **env: str) -> tuple[list[str], dict]:
    command = ["raytrain", "train", "--no-progress", "--config", str(config)]
    return [*command, "--address", head.gcs_address], head.client_env(PYTHONPATH=WORKLOADS, **env)


def write_series(path: Path) -> None:
    """Two series whose 1610 training windows make 50 steps of 32 per epoch."""
    rng = np.random.default_rng(3)
    tables = []
    for name, length in (("a", 1250), ("b", 800)):
        t = np.arange(length)
        signal = np.sin(t / 11) + rng.normal(0, 0.1, length)
        tables.append(pa.table({"series": [name] * length, "t": t, "x": signal, "y": signal**2}))
    pq.write_table(pa.concat_tables(tables), path)


def elastic_config(tmp_path: Path, name: str, **changes) -> dict:
    """Streaming windows, a forecaster without randomness after initialisation, a
    checkpoint every 10 steps."""
    cfg = fault_config(tmp_path / "runs", name)
    cfg["model"] = {"target": "window_regression:build_model", "params": {}}
    data, cache = tmp_path / "series.parquet", tmp_path / "prepared"
    params = {
        "feature_columns": ["x"],
        "target_column": "y",
        "group_column": "series",
        "time_column": "t",
        "context_length": 12,
        "horizon": 4,
    }
    if not data.exists():
        write_series(data)
        # Prepared once, here: both runs find it (the prepare pass on Ray is tested apart).
        prepare_here(str(data), params, cache)
    cfg["data"] = {"path": str(data), "streaming": True, "cache_dir": str(cache), "params": params}
    cfg["fault_tolerance"]["max_failures"] = 5
    for section, values in changes.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def uninterrupted(tmp_path: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The same training uninterrupted, on one worker in this process: every size trains
    the same optimisation, so any size would do (1 and 2 workers agree elsewhere)."""
    cfg = config_from_dict(elastic_config(tmp_path, "straight", scaling={"num_workers": 1}))
    result, weights = run_loop(
        worker_task(cfg, tmp_path / "runs" / "straight"), LocalSession(tmp_path / "straight")
    )
    return result["history"], weights


def newest_segments(run_dir: Path) -> list[list[int]]:
    """[first step, world size] of each stretch, as the newest checkpoint records them."""
    found = ckpt.checkpoints_newest_first(run_dir / "checkpoints")
    return ckpt.load_train_state(found[0])["segments"] if found else []


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_lost_node_shrinks_the_run_a_new_node_grows_it_and_it_ends_as_if_uninterrupted(
    cluster: tuple[RayHead, list[RayNode]], tmp_path: Path
):
    head, nodes = cluster
    elastic = tmp_path / "elastic.yaml"
    cfg = elastic_config(
        tmp_path,
        "elastic",
        # Slow steps, so the test can act mid-run: 20 s of 1-worker training for the new
        # node to join, where it takes under 10.
        model={"params": {"sleep_s": 0.1}},
        scaling={"num_workers": [1, 2], "elastic_resize_interval_s": 2},
    )
    elastic.write_text(yaml.safe_dump(cfg))
    command, env = train_command(
        head, elastic, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=START_TIMEOUT_S
    )
    run_dir = tmp_path / "runs" / "elastic"
    log = tmp_path / "elastic.log"
    with log.open("w") as out, subprocess.Popen(command, env=env, stdout=out, stderr=out) as proc:
        try:
            wait_for(lambda: newest_segments(run_dir) == [[0, 2]], proc, "a 2-worker checkpoint")
            nodes[0].lose()
            wait_for(lambda: newest_segments(run_dir)[-1][1] == 1, proc, "a 1-worker checkpoint")
            nodes.append(join_node(head, pythonpath=WORKLOADS))
            wait_for(lambda: newest_segments(run_dir)[-1][1] == 2, proc, "growing back to 2")
            assert proc.wait(timeout=300) == 0, log.read_text()[-5000:]
        finally:
            if proc.poll() is None:
                proc.kill()

    summary = json.loads((run_dir / "summary.json").read_text())
    sizes = [(s["step"], s["world_size"]) for s in summary["world_size_segments"]]
    assert [size for _, size in sizes] == [2, 1, 2], sizes
    assert 0 < sizes[1][0] < sizes[2][0] < STEPS, sizes
    assert summary["world_size"] == 2 and summary["worker_range"] == [1, 2]
    assert summary["status"] == "completed"

    # Within float rounding of the uninterrupted run: one worker sums its 32 samples'
    # gradients in another order than two workers' all-reduce.
    rows = read_metrics(run_dir)
    assert {r["world_size"] for r in rows} <= {1, 2} and rows[-1]["world_size"] == 2
    assert_close_to(run_dir, *uninterrupted(tmp_path), steps=[50, 100, 150, 200])
    shown = log.read_text()
    assert "plan: 1 worker(s) x micro-batch 32 x accumulation 1 = global batch 32" in shown
    assert "plan: 2 worker(s) x micro-batch 16 x accumulation 1 = global batch 32" in shown
