"""Small Parquet time series for the streaming prepare pass, and its output read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_app.data.stream_manifest import StreamManifest, group_rows, split_bounds
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
