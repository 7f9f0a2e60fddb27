"""The streaming prepare pass on a 2-node Ray cluster: with ``resources={"data_prep": 1}``
its read and per-series tasks run only on the node that offers that resource (as CPU-only
data nodes started with ``--resources='{"data_prep": 1000}'`` would), never on the head."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from paths import ROOT
from stream_data import series_table, write_files

from raytrain_app.testing.ray_head import join_node, start_head

pytestmark = pytest.mark.cluster

# The driver: joins the cluster, prepares, and prints the node ids it needs to compare.
DRIVER = """
import json, sys
import ray
from stream_data import PARAMS, ROWS_PER_GROUP
from raytrain_app.data.stream_prepare import prepare_stream

ray.init(address=sys.argv[1], logging_level="WARNING")
labelled = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "data_prep" in n["Resources"]]
others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "data_prep" not in n["Resources"]]
result = prepare_stream(
    sys.argv[2], PARAMS, sys.argv[3], resources={"data_prep": 1}, rows_per_group=ROWS_PER_GROUP
)
print(json.dumps({"labelled": labelled, "others": others, "nodes": list(result.nodes),
                  "series": len(result.manifest.series)}))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head without the resource and a node offering ``data_prep``, one CPU each."""
    head = start_head(tmp_path_factory.mktemp("prep"), 1)
    node = None
    try:
        node = join_node(head, 1, resources={"data_prep": 1000})
        yield head
    finally:
        if node is not None:
            node.stop()
        head.stop()


def test_preprocessing_tasks_run_only_on_the_labelled_node(cluster, tmp_path):
    source = write_files(tmp_path / "src", series_table())
    env = cluster.client_env(PYTHONPATH=str(ROOT / "tests" / "support"))
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, cluster.gcs_address, str(source), str(tmp_path / "cache")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen["labelled"]) == 1 and len(seen["others"]) == 1, seen
    assert seen["series"] == 4
    assert seen["nodes"] == seen["labelled"], seen  # every per-series task, none elsewhere
