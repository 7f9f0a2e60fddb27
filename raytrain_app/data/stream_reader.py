"""Reading windows of prepared streaming data: row groups in, standardised windows out.

A ``WindowBlock`` holds the row groups that a set of windows needs, standardised, and where
each window starts in them; ``gather`` cuts the windows out as one batch, as
``WindowDataset.__getitems__`` does for data in memory (the same ``x`` and ``y`` layout).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pyarrow as pa
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

# Series files a reader keeps open (``PreparedFiles._handle``): a rank reads a few series
# at a time (its lanes' blocks and the next ones), so a handful suffice; each holds a file
# descriptor, or for an object store no connection at all.
_OPEN_FILES = 32


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
        self._handles: OrderedDict[int, pa.NativeFile] = OrderedDict()  # least recent first
        self._lock = threading.Lock()  # reader threads share the footers and handles
        self.bytes_read = 0  # row groups' uncompressed bytes, for tests and the benchmark

    def read_group(self, series: int, group: int, out: np.ndarray | None = None) -> np.ndarray:
        """Row group ``group`` of series ``series``: ``[rows, features + 1]`` float32,
        standardised with the training rows' statistics; written into ``out`` when given
        (a block's rows, so that no second copy is made)."""
        entry = self.manifest.series[series]
        location = self.folder.child(entry.file)
        try:
            handle = self._handle(series, location)
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
        # The store writes float32 columns only: another type means the file was replaced.
        if (
            table.num_rows != end - begin
            or table.num_columns != self.manifest.num_columns
            or any(column.type != pa.float32() for column in table.columns)
        ):
            raise BadInputError(
                f"Prepared data file '{location}' does not match its manifest (row group "
                f"{group}); delete '{self.folder}' so that the data is prepared again."
            )
        values = np.stack([c.to_numpy().astype(np.float64) for c in table.columns], axis=1)
        with self._lock:
            self.bytes_read += table.nbytes
        if out is None:
            out = np.empty(values.shape, dtype=np.float32)
        # Scaled as data in memory is (data.scaling), then float32 (the cast on assignment
        # rounds as astype does).
        out[:] = _standardised(values, self._mean, self._std)
        return out

    def _handle(self, series: int, location: StorageLocation) -> pa.NativeFile:
        """An open handle on series ``series``' file (at ``location``), kept for the next
        row group: opening a file in an object store costs a request of its own (S3: a HEAD
        for its size) before every ranged read. The most recently used ``_OPEN_FILES``
        stay open; one dropped while a reader thread still reads it closes once that thread
        is done. Reads at an offset (what Parquet does) are safe from several threads."""
        with self._lock:
            handle = self._handles.get(series)
            if handle is not None:
                self._handles.move_to_end(series)
                return handle
        opened = location.filesystem.open_input_file(location.path)  # unlocked: a request
        with self._lock:
            handle = self._handles.setdefault(series, opened)  # another thread's if first
            self._handles.move_to_end(series)
            while len(self._handles) > _OPEN_FILES:
                self._handles.popitem(last=False)
        return handle

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
    # (series, row group) -> where that row group lies in ``rows``: lets the next block
    # copy a row group it shares with this one instead of reading it again.
    groups: dict[tuple[int, int], slice] = field(default_factory=dict)

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


def lane_positions(lanes: int, positions: int, part: slice) -> np.ndarray:
    """Where ``part`` of every lane's block lies in a block that holds the lanes' windows
    lane after lane (``positions`` each)."""
    lane_starts = np.arange(lanes, dtype=np.int64)[:, None] * positions
    return (lane_starts + np.arange(part.start, part.stop)).reshape(-1)


class PendingBlock:
    """A block of windows being read: its rows are allocated once, and each row group it
    needs is read into its place, on ``reads`` when given (else here and now), or copied
    from ``held``, a block already in memory that has it. ``result`` waits for the reads.

    Every row group is read at most once per block, however many of the block's windows
    (of however many lanes) need it.
    """

    def __init__(
        self,
        files: PreparedFiles,
        split: Split,
        window_ids: np.ndarray,
        reads: Executor | None = None,
        held: WindowBlock | None = None,
    ) -> None:
        manifest = files.manifest
        chunks = manifest.chunks(split)
        chunk, index = chunks.locate(window_ids)
        start_in_series = chunks.first[chunk] + index * manifest.stride
        keys, which = np.unique(
            np.stack([chunks.series[chunk], chunks.group[chunk]], axis=1).reshape(-1, 2),
            axis=0,
            return_inverse=True,
        )
        sizes = [_group_size(manifest, int(s), int(g)) for s, g in keys]
        bases = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        which = which.reshape(-1)
        self.block = WindowBlock(
            rows=np.empty((int(bases[-1]), manifest.num_columns), dtype=np.float32),
            starts=bases[which] + start_in_series - keys[which, 1] * manifest.rows_per_group,
            ids=window_ids,
            context_length=manifest.context_length,
            horizon=manifest.horizon,
        )
        self._reads: list[Future[None]] = []
        for (series, group), begin, end in zip(keys.tolist(), bases[:-1], bases[1:], strict=True):
            place = slice(int(begin), int(end))
            self.block.groups[(series, group)] = place
            self._fill(files, (series, group), self.block.rows[place], reads, held)

    def _fill(
        self,
        files: PreparedFiles,
        key: tuple[int, int],
        out: np.ndarray,
        reads: Executor | None,
        held: WindowBlock | None,
    ) -> None:
        if held is not None and key in held.groups:
            out[:] = held.rows[held.groups[key]]  # the same bytes a read would give
        elif reads is None:
            files.read_group(*key, out=out)
        else:
            self._reads.append(reads.submit(_read_into, files, key, out))

    def result(self) -> WindowBlock:
        for read in self._reads:
            read.result()
        return self.block

    def cancel(self) -> None:
        """Drop the reads not yet started (one running finishes into rows nobody uses)."""
        for read in self._reads:
            read.cancel()


def _read_into(files: PreparedFiles, key: tuple[int, int], out: np.ndarray) -> None:
    # Returns nothing: a finished future holding a view would keep its block's rows alive.
    files.read_group(*key, out=out)


def _group_size(manifest: StreamManifest, series: int, group: int) -> int:
    begin, end = group_rows(manifest, manifest.series[series], group)
    return end - begin


def read_windows(files: PreparedFiles, split: Split, window_ids: np.ndarray) -> WindowBlock:
    """The block of ``window_ids`` (of ``split``): every row group they need read once."""
    return PendingBlock(files, split, window_ids).result()


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
    batch and memory stays bounded (two spans); the next span's row groups are read on
    ``read_ahead`` while this one is used, but the row group two spans share is copied."""
    end = files.manifest.chunks(split).num_windows if end is None else end
    span = batch_size * max(1, BLOCK_ROWS // files.manifest.stride // batch_size)
    starts = range(begin, end, span)

    def read(first: int, held: WindowBlock | None) -> PendingBlock:
        ids = np.arange(first, min(first + span, end), dtype=np.int64)
        return PendingBlock(files, split, ids, read_ahead, held)

    pending = read(starts[0], None) if starts else None
    for index in range(len(starts)):
        block = pending.result()
        if index + 1 < len(starts):
            pending = read(starts[index + 1], block)
        for first in range(0, len(block.ids), batch_size):
            yield block.gather(slice(first, first + batch_size))
