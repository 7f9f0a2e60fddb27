"""The manifest of prepared streaming data: what the prepare pass wrote, and its windows.

The prepare pass (``stream_prepare``) writes one Parquet file per series (a group of
``data.params.group_column``), sorted by time with gaps filled, in float32 columns: the
feature columns, then the target. Row group ``j`` of a file holds the series' rows
``[j * R, j * R + R + window - 1)`` (``R``: ``rows_per_group``, ``window``: ``context_length
+ horizon``), so every window starting in ``[j * R, (j + 1) * R)`` lies inside that one
row group: a chunk (the windows of one split starting in one row group) is one read.

Everything else is a pure function of the manifest: the chunks of each split, how many
windows each holds, and which rows a window reads. Windows never cross their series or the
train/validation cut (the first ``train_rows`` rows of a series are for training).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from raytrain_app.errors import BadInputError

MANIFEST_NAME = "manifest.json"
FORMAT = 1
Split = Literal["train", "val"]


class SeriesEntry(BaseModel):
    """One prepared series: its file (relative to the manifest's folder) and sizes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    file: str = Field(pattern=r"^series/[0-9a-f]{16}\.parquet$")  # data, never a path out
    rows: int = Field(ge=1)
    train_rows: int = Field(ge=0)


class ScalingStats(BaseModel):
    """Means and standard deviations of the training rows (as ``data.scaling`` stores)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    feature_mean: list[float]
    feature_std: list[float]
    target_mean: float
    target_std: float


class StreamManifest(BaseModel):
    """What ``manifest.json`` holds; parsed strictly (it is data a team shares)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = FORMAT
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    feature_columns: list[str]
    target_column: str
    context_length: int = Field(ge=1)
    horizon: int = Field(ge=1)
    stride: int = Field(ge=1)
    season_length: int = Field(ge=1)
    rows_per_group: int = Field(ge=1)
    series: list[SeriesEntry] = Field(min_length=1)
    stats: ScalingStats
    source_files: int = Field(ge=1)
    source_bytes: int = Field(ge=0)

    @property
    def window(self) -> int:
        return self.context_length + self.horizon

    @property
    def num_columns(self) -> int:
        """Columns of a prepared file: the features, then the target."""
        return len(self.feature_columns) + 1

    # Cut once per split on first use; private, so equality compares the fields alone.
    _chunk_tables: dict[str, ChunkTable] = PrivateAttr(default_factory=dict)

    def chunks(self, split: Split) -> ChunkTable:
        """The chunks of ``split``, in manifest order (series, then row group)."""
        if split not in self._chunk_tables:
            self._chunk_tables[split] = _chunk_table(self, split)
        return self._chunk_tables[split]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StreamManifest) and self.model_dump() == other.model_dump()

    def info(self) -> dict:
        """The ``DataSplits.info`` a model factory and a checkpoint get (as in memory)."""
        return {
            "num_features": self.num_columns,
            "context_length": self.context_length,
            "horizon": self.horizon,
            "feature_columns": list(self.feature_columns),
            "target_column": self.target_column,
            "target_channel": len(self.feature_columns),
            "season_length": self.season_length,
            **self.stats.model_dump(),
        }

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> StreamManifest:
        """Parse ``text``; anything else than a manifest this version wrote names ``source``."""
        try:
            return cls.model_validate_json(text)
        except ValueError as exc:
            first = str(exc).splitlines()
            reason = first[1].strip() if len(first) > 1 else "not a manifest"
            raise BadInputError(
                f"The streaming data manifest {source} is not one raytrain wrote ({reason}); "
                "delete its folder so that the next run prepares the data again."
            ) from None


@dataclass(frozen=True)
class ChunkTable:
    """The chunks of one split, as parallel arrays (one entry per chunk).

    ``first``: the row (in its series) where the chunk's first window starts; its windows
    start at ``first + i * stride`` for ``i < count``. ``offsets``: the index of each
    chunk's first window among the split's windows (their cumulative counts).
    """

    series: np.ndarray
    group: np.ndarray
    first: np.ndarray
    count: np.ndarray

    @cached_property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.count)]).astype(np.int64)

    @property
    def num_windows(self) -> int:
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return int(self.count.shape[0])

    def locate(self, window_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk, index in chunk)`` of each of the split's ``window_ids``."""
        chunk = np.searchsorted(self.offsets, window_ids, side="right") - 1
        return chunk, window_ids - self.offsets[chunk]


def split_bounds(entry: SeriesEntry, split: Split) -> tuple[int, int]:
    """The rows ``[begin, end)`` of ``entry`` that belong to ``split``."""
    return (0, entry.train_rows) if split == "train" else (entry.train_rows, entry.rows)


def _chunk_table(manifest: StreamManifest, split: Split) -> ChunkTable:
    """Cut every series' windows of ``split`` by the row group their start lies in."""
    size, window, stride = manifest.rows_per_group, manifest.window, manifest.stride
    columns: list[list[int]] = [[], [], [], []]
    for index, entry in enumerate(manifest.series):
        begin, end = split_bounds(entry, split)
        if end - begin < window:
            continue
        windows = (end - begin - window) // stride + 1
        last_start = begin + (windows - 1) * stride
        for group in range(begin // size, last_start // size + 1):
            # window i starts at begin + i * stride; the ones in [group * size, +size)
            low = max(0, -(-(group * size - begin) // stride))
            high = min(windows, -(-((group + 1) * size - begin) // stride))
            if high > low:
                for column, value in zip(
                    columns, (index, group, begin + low * stride, high - low), strict=True
                ):
                    column.append(value)
    series, group, first, count = (np.asarray(c, dtype=np.int64) for c in columns)
    return ChunkTable(series=series, group=group, first=first, count=count)


def group_rows(manifest: StreamManifest, entry: SeriesEntry, group: int) -> tuple[int, int]:
    """The series rows ``[begin, end)`` that row group ``group`` of ``entry``'s file holds."""
    begin = group * manifest.rows_per_group
    return begin, min(begin + manifest.rows_per_group + manifest.window - 1, entry.rows)
