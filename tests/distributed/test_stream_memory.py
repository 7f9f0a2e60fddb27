"""Streaming data trains an epoch with bounded memory: doubling the data does not grow the
peak of the training worker, nor of the whole Ray process tree.

The data (float64 Parquet, one file per series) is at least 10x the worker's allowance for
data: the read-ahead bound that ``stream_batches.read_ahead_bytes`` computes from the lanes a
rank reads (here one worker reads all 8): two blocks of its lanes, the one it trains on and
the one read ahead (at the epoch's end the next epoch's first, whose read starts while the
epoch ends), or that next block and two spans of validation windows. The prepare pass
runs first, on its own and in this process (its memory on Ray is Ray Data's shuffle, not
training's), and training then finds its output in ``data.cache_dir``. While the epoch
trains, a sampler reads from /proc the training worker's peak resident memory (VmHWM:
exact, however brief the peak) and the proportional set size (PSS: shared pages counted
once) of every process of this session's Ray: Ray's own accounting does not see what
workers hold (ray#65544).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from stream_data import prepare_here, stream_run_config

import raytrain_app as rt
from raytrain_app.testing.processes import descendants, pids_naming
from raytrain_app.worker.stream_batches import read_ahead_bytes

pytestmark = pytest.mark.distributed

ROWS_PER_SERIES = 300_000
SERIES = 8  # at the base size; the doubled data has twice as many
FEATURES = ["f0", "f1", "f2"]
PARAMS = {
    "feature_columns": FEATURES,
    "target_column": "y",
    "group_column": "series",
    "time_column": "t",
    "context_length": 24,
    "horizon": 6,
    "stride": 1024,  # few windows, all of the rows still read: an epoch takes seconds
}


def _write_data(folder: Path, series: int) -> int:
    """One Parquet file per series; returns the bytes of the columns training reads."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(series)
    for index in range(series):
        values = {name: rng.normal(size=ROWS_PER_SERIES) for name in [*FEATURES, "y"]}
        table = pa.table(
            {"series": np.full(ROWS_PER_SERIES, index), "t": np.arange(ROWS_PER_SERIES), **values}
        )
        pq.write_table(table, folder / f"series{index}.parquet")
    return series * ROWS_PER_SERIES * (len(FEATURES) + 1) * 8


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:  # it exited while we looked
        pass
    return 0


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()[:60]
    except OSError:
        return "?"


def _peak_rss_bytes(pid: int) -> int:
    """The process's high-water mark of resident memory (VmHWM): its exact peak, whenever
    it was reached, however briefly."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _is_train_worker(pid: int) -> bool:
    try:
        return b"RayTrainWorker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class _PeakSampler(threading.Thread):
    """Samples this session's Ray processes until stopped: the training worker's peak
    resident memory, and the PSS of the whole tree (the raylet, its workers, the GCS)."""

    def __init__(self, ray_temp_dir: str) -> None:
        super().__init__(daemon=True)
        self.roots = pids_naming("raylet", ray_temp_dir) + pids_naming("gcs_server", ray_temp_dir)
        assert self.roots, "no Ray processes found for this session"
        self.worker_peak = self.tree_peak = 0
        self.tree_at_peak: list[tuple[int, str]] = []  # (MiB, process) of the larger ones
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            pids = set(self.roots).union(*(descendants(root) for root in self.roots))
            sizes = {pid: _pss_bytes(pid) for pid in pids}
            workers = [_peak_rss_bytes(pid) for pid in sizes if _is_train_worker(pid)]
            self.worker_peak = max(self.worker_peak, *workers, 0)
            if sum(sizes.values()) > self.tree_peak:
                self.tree_peak = sum(sizes.values())
                self.tree_at_peak = sorted(
                    (size >> 20, _name(pid)) for pid, size in sizes.items() if size > 20 << 20
                )
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _ray_temp_dir() -> str:
    import ray

    return ray._private.worker._global_node.get_temp_dir_path()


@pytest.fixture(scope="module")
def peaks(ray_cluster, tmp_path_factory) -> dict[int, dict]:
    """Per data size (x1, x2): its bytes, the allowance, and the sampled peaks of one epoch.

    Both sizes are prepared before either trains, so that what Ray keeps of the prepare
    passes (idle worker processes) is the same under both trainings."""
    root = tmp_path_factory.mktemp("stream-memory")
    cache = root / "cache"
    prepared = {}
    for factor in (1, 2):
        data = root / f"data{factor}"
        data_bytes = _write_data(data, SERIES * factor)
        manifest = prepare_here(str(data), PARAMS, cache).manifest
        prepared[factor] = (data, data_bytes, manifest)
    found = {}
    for factor, (data, data_bytes, manifest) in prepared.items():
        output = str(root / "runs")
        config = stream_run_config(
            f"x{factor}", output, str(data), str(cache), PARAMS, global_batch_size=8
        )
        sampler = _PeakSampler(_ray_temp_dir())
        sampler.start()
        try:
            result = rt.train(config, progress=False)
        finally:
            sampler.stop()
        found[factor] = {
            "data_bytes": data_bytes,
            # One worker reads all 8 lanes (global batch 8).
            "allowance": read_ahead_bytes(
                manifest.rows_per_group, manifest.window, manifest.num_columns, lanes_per_rank=8
            ),
            "steps": result.metrics[-1]["step"],
            "worker": sampler.worker_peak,
            "tree": sampler.tree_peak,
            "tree_at_peak": sampler.tree_at_peak,
            "summary": result.summary,
        }
    return found


def test_the_data_is_at_least_ten_times_the_workers_allowance(peaks):
    assert peaks[1]["data_bytes"] >= 10 * peaks[1]["allowance"], peaks
    assert peaks[2]["steps"] >= 2 * peaks[1]["steps"] - 1  # an epoch of twice the windows


def test_the_goodput_parts_of_a_streaming_run_sum_to_its_wall_time(peaks):
    for found in peaks.values():
        goodput, wall = found["summary"]["goodput"], found["summary"]["wall_time_s"]
        assert sum(goodput.values()) == pytest.approx(wall, rel=0.02), goodput
        # The reader's waits for its next block are data waits.
        assert goodput["data_wait_s"] > 0 and goodput["compute_s"] > 0, goodput


def test_doubling_the_data_does_not_grow_the_workers_peak_nor_the_ray_trees(peaks):
    base, double = peaks[1], peaks[2]
    added = double["data_bytes"] - base["data_bytes"]
    shown = {
        factor: {k: v >> 20 if isinstance(v, int) else v for k, v in found.items()}
        for factor, found in peaks.items()
    }  # MiB, for the message
    # Loading instead of streaming would add the extra data to the worker at least once
    # (float64 columns, then float32 windows); streaming adds nothing but noise: pyarrow's
    # and torch's pools, the interpreter (about 10 MiB either way, run to run).
    assert double["worker"] - base["worker"] <= added / 5, shown
    # The tree also holds Ray's own processes (GCS, raylet and its object store, idle
    # workers), whose memory moves by more than a worker's between runs.
    assert double["tree"] - base["tree"] <= added / 2, shown
