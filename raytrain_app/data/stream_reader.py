"""Reading windows of prepared streaming data: row groups in, standardised windows out.

A ``WindowBlock`` holds the row groups that a set of windows needs, standardised, and where
each window starts in them; ``gather`` cuts the windows out as one batch, as
``WindowDataset.__getitems__`` does for data in memory (the same ``x`` and ``y`` layout).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow.parquet as pq
import torch

from raytrain_app.data.scaling import _standardised
from raytrain_app.data.stream_manifest import (
    MANIFEST_NAME,
    Split,
    StreamManifest,
    group_rows,
)
from raytrain_app.data.stream_order import BLOCK_ROWS
from raytrain_app.errors import BadInputError, first_line
from raytrain_app.storage import StorageLocation


def load_manifest(folder: str) -> StreamManifest:
    """The manifest in ``folder`` (a local path or a URI), checked against its folder name."""
    location = StorageLocation.parse(folder, "data.path")
    source = f"'{location.child(MANIFEST_NAME)}'"
    try:
        text = location.child(MANIFEST_NAME).read_text()
    except (OSError, FileNotFoundError) as exc:
        raise BadInputError(
            f"The streaming data manifest {source} cannot be read ({first_line(exc)}); run "
            "again so that the data is prepared, or check that every node sees that folder."
        ) from None
    manifest = StreamManifest.from_json(text, source)
    if manifest.key != location.name:
        raise BadInputError(
            f"The streaming data manifest {source} was written for other data (key "
            f"{manifest.key[:12]}...); delete its folder so that the data is prepared again."
        )
    return manifest


class PreparedFiles:
    """The prepared series files of one manifest; reads row groups, standardised."""

    def __init__(self, manifest: StreamManifest, folder: str) -> None:
        self.manifest = manifest
        self.folder = StorageLocation.parse(folder, "data.path")
        stats = manifest.stats
        self._mean = np.asarray([*stats.feature_mean, stats.target_mean], dtype=np.float64)
        self._std = np.asarray([*stats.feature_std, stats.target_std], dtype=np.float64)
        self._footers: dict[int, pq.FileMetaData] = {}
        self._lock = threading.Lock()  # reader threads share the footers
        self.bytes_read = 0  # row groups' uncompressed bytes, for tests and the benchmark

    def read_group(self, series: int, group: int) -> np.ndarray:
        """Row group ``group`` of series ``series``: ``[rows, features + 1]`` float32,
        standardised with the training rows' statistics."""
        entry = self.manifest.series[series]
        location = self.folder.child(entry.file)
        try:
            with location.filesystem.open_input_file(location.path) as handle:
                parquet = pq.ParquetFile(handle, metadata=self._footer(series))
                table = parquet.read_row_group(group)
                with self._lock:
                    self._footers.setdefault(series, parquet.metadata)
        except (OSError, ValueError) as exc:
            raise BadInputError(
                f"Prepared data file '{location}' cannot be read ({first_line(exc)}); delete "
                f"'{self.folder}' so that the data is prepared again."
            ) from None
        begin, end = group_rows(self.manifest, entry, group)
        if table.num_rows != end - begin or table.num_columns != self.manifest.num_columns:
            raise BadInputError(
                f"Prepared data file '{location}' does not match its manifest (row group "
                f"{group}); delete '{self.folder}' so that the data is prepared again."
            )
        values = np.stack([c.to_numpy().astype(np.float64) for c in table.columns], axis=1)
        with self._lock:
            self.bytes_read += table.nbytes
        # Scaled as data in memory is (data.scaling), then float32.
        return _standardised(values, self._mean, self._std).astype(np.float32)

    def _footer(self, series: int) -> pq.FileMetaData | None:
        with self._lock:
            return self._footers.get(series)


@dataclass
class WindowBlock:
    """Standardised rows and the row where each of a block's windows starts in them."""

    rows: np.ndarray  # [rows, features + 1], float32
    starts: np.ndarray  # [windows], int64, in the block's order
    ids: np.ndarray  # [windows], the windows' ids among the split's windows
    context_length: int
    horizon: int

    @cached_property
    def _tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.rows)

    def gather(self, part: slice | np.ndarray) -> list[torch.Tensor]:
        """The windows at ``part`` of the block: ``[x, y]`` with ``x`` ``[B, context,
        features + 1]`` and ``y`` ``[B, horizon]`` (the standardised target)."""
        starts = torch.from_numpy(self.starts[part])[:, None]
        x_rows = starts + torch.arange(self.context_length)
        y_rows = starts + torch.arange(self.context_length, self.context_length + self.horizon)
        return [self._tensor[x_rows], self._tensor[:, -1][y_rows]]


def merge_blocks(blocks: list[WindowBlock]) -> WindowBlock:
    """Equal-length blocks (one per lane) as one, lane after lane: a step then takes its
    windows of every lane with one gather (``lane_positions``)."""
    if len(blocks) == 1:
        return blocks[0]
    bases = np.cumsum([0, *(len(b.rows) for b in blocks[:-1])])
    return WindowBlock(
        rows=np.concatenate([b.rows for b in blocks]),
        starts=np.concatenate([b.starts + base for b, base in zip(blocks, bases, strict=True)]),
        ids=np.concatenate([b.ids for b in blocks]),
        context_length=blocks[0].context_length,
        horizon=blocks[0].horizon,
    )


def lane_positions(lanes: int, positions: int, part: slice) -> np.ndarray:
    """Where ``part`` of every lane's block lies in their merge, lane after lane."""
    lane_starts = np.arange(lanes, dtype=np.int64)[:, None] * positions
    return (lane_starts + np.arange(part.start, part.stop)).reshape(-1)


def read_windows(files: PreparedFiles, split: Split, window_ids: np.ndarray) -> WindowBlock:
    """The block of ``window_ids`` (of ``split``): every row group they need read once."""
    manifest = files.manifest
    chunks = manifest.chunks(split)
    chunk, index = chunks.locate(window_ids)
    series, group = chunks.series[chunk], chunks.group[chunk]
    start_in_series = chunks.first[chunk] + index * manifest.stride
    keys, which = np.unique(np.stack([series, group], axis=1), axis=0, return_inverse=True)
    parts = [files.read_group(int(s), int(g)) for s, g in keys]
    bases = np.concatenate([[0], np.cumsum([len(p) for p in parts])[:-1]]).astype(np.int64)
    group_begin = keys[:, 1] * manifest.rows_per_group
    which = which.reshape(-1)
    starts = bases[which] + start_in_series - group_begin[which]
    rows = np.concatenate(parts) if parts else np.empty((0, manifest.num_columns), np.float32)
    return WindowBlock(rows, starts, window_ids, manifest.context_length, manifest.horizon)


def window_batches(
    files: PreparedFiles,
    split: Split,
    batch_size: int,
    read_ahead: Executor,
    begin: int = 0,
    end: int | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Windows ``[begin, end)`` of ``split`` (default: all) in manifest order, in batches of
    ``batch_size``. They are read in spans of whole batches starting within about
    ``BLOCK_ROWS`` rows, so that a row group is read once per span rather than once per
    batch and memory stays bounded; the next span is read on ``read_ahead`` while this
    one is used."""
    end = files.manifest.chunks(split).num_windows if end is None else end
    span = batch_size * max(1, BLOCK_ROWS // files.manifest.stride // batch_size)
    starts = range(begin, end, span)

    def read(first: int) -> WindowBlock:
        ids = np.arange(first, min(first + span, end), dtype=np.int64)
        return read_windows(files, split, ids)

    reads = [read_ahead.submit(read, first) for first in starts[:1]]
    for index in range(len(starts)):
        if index + 1 < len(starts):
            reads.append(read_ahead.submit(read, starts[index + 1]))
        block = reads.pop(0).result()
        for first in range(0, len(block.ids), batch_size):
            yield block.gather(slice(first, first + batch_size))
