"""Streaming data trains with bounded memory, its prepare pass included: four times the
data, a file per series, does not grow the peak of `raytrain train`'s driver (by 10 % at
most), of the training worker, nor of the whole process tree (by 25 % at most).

Each size runs `raytrain train` in a subprocess with its own embedded Ray, as a user runs
it: the prepare pass on Ray Data (the direct path: a task per series reading its own row
groups, no shuffle), then an epoch. The files hold their series in small row groups (10k
rows), as exports often do: the shuffle these files once took held the whole data on the
driver (the sort's pieces under 100 KB live with their owner) and in the object store.

The data (float64 Parquet) is at least 10x the worker's allowance for data: the read-ahead
bound that ``stream_batches.read_ahead_bytes`` computes from the lanes a rank reads (here
one worker reads both): two blocks of its lanes, the one it trains on and the one read
ahead (at the epoch's end the next epoch's first, whose read starts while the epoch ends),
or that next block and two spans of validation windows. While the command runs, a sampler
reads from /proc the training worker's peak resident memory (VmHWM: exact, however brief
the peak), the driver's, and the proportional set size (PSS: shared pages counted once) of
the driver and of every process it started, Ray's included: Ray's own accounting does not
see what workers hold (ray#65544).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from fault_runs import cli_env
from stream_data import stream_run_config
from tree_memory import TreePeak

from raytrain_app.data.stream_prepare import locate_store
from raytrain_app.testing.isolation import ray_temp_dir
from raytrain_app.testing.processes import stop_processes_naming
from raytrain_app.tracking.metrics_log import read_metrics
from raytrain_app.worker.stream_batches import read_ahead_bytes

pytestmark = pytest.mark.distributed

ROWS_PER_SERIES = 100_000
ROWS_PER_GROUP = 10_000  # of the source files
SERIES = 8  # at the base size; the larger data has four times as many
FACTOR = 4
FEATURES = ["f0", "f1", "f2"]
PARAMS = {
    "feature_columns": FEATURES,
    "target_column": "y",
    "group_column": "series",
    "time_column": "t",
    "context_length": 24,
    "horizon": 6,
    "stride": 4096,  # one window a row group: few steps, every row still read
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
        pq.write_table(table, folder / f"series{index}.parquet", row_group_size=ROWS_PER_GROUP)
    return series * ROWS_PER_SERIES * (len(FEATURES) + 1) * 8


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


class _PeakSampler(TreePeak):
    """Samples a command and every process it started until stopped: the tree's PSS, and
    the training worker's and the driver's peak resident memory and the driver's PSS."""

    def __init__(self, driver: int) -> None:
        super().__init__(driver)
        self.worker_peak = self.driver_peak = self.driver_hwm = 0

    def observe(self, sizes: dict[int, int]) -> None:
        workers = [_peak_rss_bytes(pid) for pid in sizes if _is_train_worker(pid)]
        self.worker_peak = max(self.worker_peak, *workers, 0)
        self.driver_peak = max(self.driver_peak, sizes[self.root])
        self.driver_hwm = max(self.driver_hwm, _peak_rss_bytes(self.root))


def _train_sampled(config: dict, folder: Path) -> tuple[_PeakSampler, str, float]:
    """`raytrain train` on ``config`` with its own embedded Ray, sampled; its output, and
    when the command was launched (wall clock)."""
    file = folder / f"{config['experiment']['name']}.yaml"
    file.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "raytrain_app.cli", "train", "--no-progress"]
    ray_tmp = ray_temp_dir()
    try:
        launched_at = time.time()
        with subprocess.Popen(
            [*command, "--config", str(file)],
            env=cli_env(ray_tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc:
            sampler = _PeakSampler(proc.pid)
            sampler.start()
            try:
                output, _ = proc.communicate(timeout=300)
            finally:
                sampler.stop()
        assert proc.returncode == 0, output[-3000:]
        return sampler, output, launched_at
    finally:  # anything of its Ray left behind, even on failure
        stop_processes_naming(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def peaks(tmp_path_factory) -> dict[int, dict]:
    """Per data size (x1, x4): its bytes, the allowance, and the sampled peaks of one
    `raytrain train` (prepare pass and epoch)."""
    root = tmp_path_factory.mktemp("stream-memory")
    cache = root / "cache"
    found = {}
    for factor in (1, FACTOR):
        data = root / f"data{factor}"
        data_bytes = _write_data(data, SERIES * factor)
        config = stream_run_config(
            f"x{factor}", str(root / "runs"), str(data), str(cache), PARAMS, global_batch_size=2
        )
        sampler, output, launched_at = _train_sampled(config, root)
        manifest = locate_store(str(data), PARAMS, cache).prepared()
        run_dir = root / "runs" / f"x{factor}"
        found[factor] = {
            "data_bytes": data_bytes,
            # One worker reads both lanes (global batch 2).
            "allowance": read_ahead_bytes(
                manifest.rows_per_group, manifest.window, manifest.num_columns, lanes_per_rank=2
            ),
            "steps": read_metrics(run_dir)[-1]["step"],
            "prepared": [line for line in output.splitlines() if "Prepared " in line],
            "worker": sampler.worker_peak,
            "driver": sampler.driver_peak,
            "driver_hwm": sampler.driver_hwm,
            "tree": sampler.tree_peak,
            "tree_at_peak": sampler.tree_at_peak,
            "summary": json.loads((run_dir / "summary.json").read_text()),
            # from the command's launch to its summary
            "command_s": (run_dir / "summary.json").stat().st_mtime - launched_at,
        }
    return found


def test_the_data_is_at_least_ten_times_the_workers_allowance(peaks):
    assert peaks[1]["data_bytes"] >= 10 * peaks[1]["allowance"], peaks
    # an epoch of four times the windows
    assert peaks[FACTOR]["steps"] >= FACTOR * (peaks[1]["steps"] - 1), peaks
    for found in peaks.values():  # prepared on Ray, each series from its own row groups
        (line,) = found["prepared"]
        assert "on 1 Ray node(s), each series from its own row groups" in line, line


def test_the_goodput_parts_of_a_streaming_run_sum_to_its_wall_time(peaks):
    for found in peaks.values():
        goodput, wall = found["summary"]["goodput"], found["summary"]["wall_time_s"]
        assert sum(goodput.values()) == pytest.approx(wall, rel=0.02), goodput
        # The run's time counts from the command's start: its imports (torch, Ray: some
        # seconds) are start-up too. The summary is written right after it is measured.
        assert wall >= found["command_s"] - 0.5, (wall, found["command_s"])
        # The reader's waits for its next block are data waits.
        assert goodput["data_wait_s"] > 0 and goodput["compute_s"] > 0, goodput


def test_four_times_the_data_does_not_grow_the_driver_the_worker_nor_the_tree(peaks):
    base, large = peaks[1], peaks[FACTOR]
    added = large["data_bytes"] - base["data_bytes"]
    shown = {
        factor: {k: v >> 20 if isinstance(v, int) else v for k, v in found.items()}
        for factor, found in peaks.items()
    }  # MiB, for the message
    # The driver holds a row of metadata a series, Ray Data's bookkeeping a task: the
    # shuffle these files once took grew it from about 390 to 920 MiB (PSS).
    assert large["driver"] <= 1.10 * base["driver"], shown
    assert large["driver_hwm"] <= 1.10 * base["driver_hwm"], shown
    # Loading instead of streaming would add the extra data to the worker at least once
    # (float64 columns, then float32 windows); streaming adds nothing but noise: pyarrow's
    # and torch's pools, the interpreter (about 10 MiB either way, run to run).
    assert large["worker"] - base["worker"] <= added / 5, shown
    # The tree also holds Ray's own processes (GCS, raylet and its object store, idle
    # workers), whose memory moves by more than a worker's between two Ray instances (up
    # to 100 MiB here); the shuffle grew it from about 2.2 to 3.0 GiB.
    assert large["tree"] <= 1.25 * base["tree"], shown
