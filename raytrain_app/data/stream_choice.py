"""Whether Parquet data streams (``data.streaming``), and how big it is on disk."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from raytrain_app.data.parquet_source import DataFile, PathLike, resolve_paths

# data.streaming: auto streams above this: loading it into every worker would hold several
# copies of it (the table, the float64 columns, the float32 windows) per worker process.
AUTO_STREAM_BYTES = 1 << 30


def file_bytes(files: Sequence[DataFile]) -> int:
    """The files' total size on disk (compressed Parquet), from a listing: no data read."""
    total = 0
    for file in files:
        if isinstance(file, Path):
            total += file.stat().st_size
        else:
            total += file.filesystem.get_file_info(file.path).size or 0
    return total


def streams(setting: str | bool, path: PathLike | Sequence[PathLike]) -> bool:
    """``data.streaming`` resolved for ``path``: ``auto`` streams above ``AUTO_STREAM_BYTES``."""
    if setting != "auto":
        return bool(setting)
    return file_bytes(resolve_paths(path)) > AUTO_STREAM_BYTES
