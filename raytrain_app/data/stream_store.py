"""The prepared store's bookkeeping: its key, whether it is complete, and its manifest.

A store lives in ``cache_root/<key>/``; ``key`` hashes the source files (name, size,
mtime), every window parameter and the row-group size, so changed inputs get a new store.
The manifest is assembled from the per-series tasks' metadata in the group column's order,
whatever order the tasks finished in, so that it is the same bytes on every run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from raytrain_app.data.parquet_source import DataFile
from raytrain_app.data.scaling import _refuse_huge_target
from raytrain_app.data.stream_manifest import (
    FORMAT,
    MANIFEST_NAME,
    ScalingStats,
    SeriesEntry,
    StreamManifest,
)
from raytrain_app.data.stream_series import SeriesSpec
from raytrain_app.storage import StorageLocation

FileInfo = tuple[str, int | None, int | None]  # path or URI, size, mtime in ns


def store_key(infos: list[FileInfo], params: Mapping, size: int) -> str:
    """sha256 of the format, the files (name, size, mtime), every window param and R."""
    material = {
        "format": FORMAT,
        "files": [list(info) for info in infos],
        "params": dict(params),
        "rows_per_group": size,
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def file_info(file: DataFile) -> FileInfo:
    """(path or URI, size, mtime in ns) as the file's filesystem reports them."""
    location = file if isinstance(file, StorageLocation) else StorageLocation.local(file)
    info = location.filesystem.get_file_info(location.path)
    return location.uri, info.size, info.mtime_ns


def complete_store(store: StorageLocation, key: str) -> StreamManifest | None:
    """The manifest of a complete store for ``key``; None when there is none."""
    file = store.child(MANIFEST_NAME)
    if not file.is_file():
        return None
    manifest = StreamManifest.from_json(file.read_text(), file.uri)
    return manifest if manifest.key == key else None


def build_manifest(
    key: str,
    args: Mapping,
    size: int,
    metadata: pa.Table,
    infos: list[FileInfo],
    spec: SeriesSpec,
) -> StreamManifest:
    """The manifest: series in the group column's order, statistics reduced in that order."""
    if "key" in metadata.column_names:  # numbers in numeric order, as the in-memory path
        metadata = metadata.sort_by([("key", "ascending")])
    rows = metadata.select(["id", "file", "rows", "train_rows"]).to_pylist()
    return StreamManifest(
        key=key,
        feature_columns=list(args["feature_columns"]),
        target_column=args["target_column"],
        context_length=args["context_length"],
        horizon=args["horizon"],
        stride=args["stride"],
        season_length=args["season_length"],
        rows_per_group=size,
        series=[SeriesEntry(**row) for row in rows],
        stats=combined_stats(metadata, spec),
        source_files=len(infos),
        source_bytes=sum(info[1] or 0 for info in infos),
    )


def combined_stats(metadata: pa.Table, spec: SeriesSpec) -> ScalingStats:
    """Chan's parallel formula over the series in manifest order, in float64: the same
    bits whatever order the tasks finished in."""
    count, mean, m2 = 0, np.zeros(len(spec.columns)), np.zeros(len(spec.columns))
    parts = zip(
        *(metadata.column(c).to_pylist() for c in ("train_rows", "mean", "m2")), strict=True
    )
    for n, part_mean, part_m2 in parts:
        total = count + n
        delta = np.asarray(part_mean) - mean
        mean = mean + delta * (n / total)
        m2 = m2 + np.asarray(part_m2) + delta**2 * (count * n / total)
        count = total
    std = np.sqrt(m2 / count)
    std = np.where(std > 1e-12, std, 1.0)  # a constant column, as scaling._stats
    _refuse_huge_target(float(mean[-1]), float(std[-1]), spec.target_column, spec.source)
    return ScalingStats(
        feature_mean=[float(v) for v in mean[:-1]],
        feature_std=[float(v) for v in std[:-1]],
        target_mean=float(mean[-1]),
        target_std=float(std[-1]),
    )
