"""Whether Parquet data streams (``data.streaming``), and how big it is on disk."""

from __future__ import annotations

from collections.abc import Sequence

from raytrain_app.data.parquet_source import DataFile, PathLike, resolve_paths
from raytrain_app.data.stream_store import file_info
from raytrain_app.storage import StorageLocation

# data.streaming: auto streams above this: loading it into every worker would hold several
# copies of it (the table, the float64 columns, the float32 windows) per worker process.
AUTO_STREAM_BYTES = 1 << 30


def file_bytes(files: Sequence[DataFile]) -> int:
    """The files' total size on disk (compressed Parquet), from a listing: no data read."""
    local = [file if isinstance(file, StorageLocation) else file.absolute() for file in files]
    return sum(file_info(file)[1] or 0 for file in local)


def streams(setting: str | bool, path: PathLike | Sequence[PathLike]) -> bool:
    """``data.streaming`` resolved for ``path``: ``auto`` streams above ``AUTO_STREAM_BYTES``."""
    if setting != "auto":
        return bool(setting)
    return file_bytes(resolve_paths(path)) > AUTO_STREAM_BYTES
