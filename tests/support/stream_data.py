"""Small Parquet time series for the streaming prepare pass, and its output read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_app.data.stream_manifest import StreamManifest, group_rows, split_bounds
from raytrain_app.data.stream_order import EpochOrder
from raytrain_app.data.stream_reader import lane_positions
from raytrain_app.storage import StorageLocation

# Ids whose text order (10 < 2 < 3 < 7) is not their numeric order; lengths that give one
# row group (50 rows), several (300 with 64 rows a group) and ragged ends.
LENGTHS = {3: 150, 10: 300, 2: 50, 7: 90}
PARAMS = {
    "feature_columns": ["wind", "temp"],
    "target_column": "power",
    "group_column": "turbine",
    "time_column": "hour",
    "context_length": 8,
    "horizon": 4,
    "val_fraction": 0.25,
    "stride": 2,
    "season_length": 2,
    "missing": "interpolate",
}
ROWS_PER_GROUP = 64


def series_table(seed: int = 0, lengths: dict[int, int] = LENGTHS, gaps: bool = True) -> pa.Table:
    """Every series' rows, shuffled (not in time order), with a few NaNs when ``gaps``."""
    rng = np.random.default_rng(seed)
    parts = []
    for turbine, n in lengths.items():
        hour = np.arange(n)
        wind = np.sin(hour / 7 + turbine) + 0.1 * rng.standard_normal(n)
        temp = 0.5 * rng.standard_normal(n) + turbine / 10
        power = wind**2 + 0.05 * rng.standard_normal(n)
        if gaps:
            for column in (wind, power):
                column[rng.choice(np.arange(1, n - 1), size=3, replace=False)] = np.nan
        parts.append(
            {
                "turbine": np.full(n, turbine),
                "hour": hour,
                "wind": wind,
                "temp": temp,
                "power": power,
            }
        )
    columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = rng.permutation(len(columns["hour"]))
    return pa.table({k: v[order] for k, v in columns.items()})


def write_files(folder: Path, table: pa.Table, files: int = 2) -> Path:
    """``table`` cut into ``files`` Parquet files (small row groups) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    edges = np.linspace(0, table.num_rows, files + 1).astype(int)
    for k in range(files):
        part = table.slice(edges[k], edges[k + 1] - edges[k])
        pq.write_table(part, folder / f"part-{k}.parquet", row_group_size=100)
    return folder


def write_series_files(folder: Path, table: pa.Table, row_group_size: int = 40) -> Path:
    """``table``'s series one file each (rows in ``table``'s order, small row groups), as
    SCADA exports write them: the prepare pass's direct path reads them."""
    folder.mkdir(parents=True, exist_ok=True)
    turbines = table.column("turbine").to_numpy()
    for turbine in np.unique(turbines):
        part = table.filter(turbines == turbine)
        pq.write_table(part, folder / f"turbine-{turbine}.parquet", row_group_size=row_group_size)
    return folder


def write_interleaved(folder: Path, series: int, rows: int, files: int = 4) -> Path:
    """``series`` series of ``rows`` rows each (the columns of ``PARAMS``, no gaps), every
    file holding a stretch of hours of every series in random order, in row groups of 50k
    rows that each hold every series: the prepare pass shuffles. Written a file at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(series)
    edges = np.linspace(0, rows, files + 1).astype(int)
    for k in range(files):
        hours = np.arange(edges[k], edges[k + 1])
        order = rng.permutation(series * len(hours))
        size = len(order)
        table = pa.table(
            {
                "turbine": np.repeat(np.arange(series), len(hours))[order],
                "hour": np.tile(hours, series)[order],
                **{name: rng.normal(size=size) for name in ("wind", "temp", "power")},
            }
        )
        pq.write_table(table, folder / f"part-{k}.parquet", row_group_size=50_000)
    return folder


def store_files(location: str) -> dict[str, bytes]:
    """Every file of a prepared store (relative name -> bytes)."""
    root = StorageLocation.parse(location, "test")
    return {f.path[len(root.path) + 1 :]: f.read_bytes() for f in root.list_dir(True, True)}


def read_windows(
    manifest: StreamManifest, location: str, split: str
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """``x``, ``y`` and (series, start) of every window of ``split`` in manifest order,
    standardised as a reader would; checks each lies in its series, split and row group."""
    root = StorageLocation.parse(location, "test")
    stats = manifest.stats
    mean = np.asarray([*stats.feature_mean, stats.target_mean])
    std = np.asarray([*stats.feature_std, stats.target_std])
    table = manifest.chunks(split)
    xs, ys, where = [], [], []
    c, h = manifest.context_length, manifest.horizon
    for s, g, first, count in zip(table.series, table.group, table.first, table.count, strict=True):
        entry = manifest.series[s]
        file = root.child(entry.file)
        rows = pq.ParquetFile(file.path, filesystem=file.filesystem).read_row_group(int(g))
        values = np.stack([rows.column(k).to_numpy() for k in range(rows.num_columns)], axis=1)
        begin, end = group_rows(manifest, entry, int(g))
        assert values.shape[0] == end - begin
        low, high = split_bounds(entry, split)
        for i in range(int(count)):
            start = int(first) + i * manifest.stride
            assert low <= start and start + manifest.window <= high, (entry, start, split)
            assert begin <= start and start + manifest.window <= end, (entry, start, g)
            window = (values[start - begin : start - begin + manifest.window] - mean) / std
            xs.append(window[:c].astype(np.float32))
            ys.append(window[c : c + h, -1].astype(np.float32))
            where.append((int(s), start))
    return np.stack(xs), np.stack(ys), where


def stream_run_config(
    name: str, output_dir: str, path: str, cache_dir: str, params: dict, **train
) -> dict:
    """A run of ``window_regression`` on streaming ``path`` (prepared into ``cache_dir``):
    one worker, no trackers, no retries."""
    return {
        "experiment": {"name": name, "output_dir": output_dir},
        "data": {"path": path, "streaming": True, "cache_dir": cache_dir, "params": params},
        "model": {"target": "window_regression:build_model", "params": {"hidden": 8}},
        "train": {"epochs": 1, "lr": 3e-3, **train},
        "scaling": {"num_workers": 1},
        "tracking": {"tensorboard": False, "loss_plot": False},
        "fault_tolerance": {"max_failures": 0},
    }


def prepare_here(path: str, params: dict, cache: Any, **options: Any) -> Any:
    """``prepare_stream`` in this process even where Ray is up (the same bytes, as
    tests/distributed/test_stream_prepare_on_ray.py shows): for tests about what happens
    after the prepare pass, without paying Ray Data's start-up in each."""
    import pytest

    from raytrain_app.data import stream_prepare

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_prepare, "_ray_initialized", lambda: False)
        return stream_prepare.prepare_stream(path, params, cache, **options)


def step_ids(order: EpochOrder, step: int, lanes: range | list[int]) -> np.ndarray:
    """The window ids ``step`` takes from ``lanes``, lane after lane: as a rank reading
    ``lanes`` takes them (``worker.stream_batches``), from the block holding the step."""
    ids = order.block_ids(order.block_of_step(step), lanes)
    return ids[lane_positions(len(lanes), len(ids) // len(lanes), order.step_slice(step))]
