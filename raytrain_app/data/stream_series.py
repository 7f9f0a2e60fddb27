"""One series of the streaming prepare pass: read its rows, order and fill them, write its file.

``prepare_series`` is the unit of work that Ray Data runs once per series (``map_groups``)
and the in-process pass runs in a loop; both give the same bytes. Its result is one row of
metadata: the series' sizes and its training rows' per-column count, mean and M2. A series
too short for a window is not written; its row only tells its length, so that the driver
names every such series in one refusal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_app.data.missing import fill_missing
from raytrain_app.data.parquet_source import DataFile, column_as_float
from raytrain_app.data.scaling import _refuse_non_finite
from raytrain_app.data.series_split import series_fits, split_rows
from raytrain_app.errors import BadInputError, first_line
from raytrain_app.storage import StorageLocation

# Where each row came from (file, row in file): equal time stamps, and a series without a
# time column, keep the file order, as the in-memory path's stable sort keeps it.
FILE_COLUMN = "__raytrain_file"
ROW_COLUMN = "__raytrain_row"
NO_GROUP_ID = "all"  # the id of the one series when data.params.group_column is unset
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SeriesSpec:
    """What every per-series task needs; picklable (it travels to Ray workers)."""

    feature_columns: tuple[str, ...]
    target_column: str
    group_column: str | None
    time_column: str | None
    window: int
    val_fraction: float
    missing: str
    rows_per_group: int
    source: str  # the data path as the user gave it, for messages
    store: StorageLocation  # the prepared store's folder (cache_root/<key>)

    @property
    def columns(self) -> list[str]:
        """The prepared file's columns: the features, then the target."""
        return [*self.feature_columns, self.target_column]


@dataclass(frozen=True)
class ReadUnit:
    """One row group of one source file, the row (in its file) where it starts, and its
    number of rows."""

    file_index: int
    row_group: int
    first_row: int
    rows: int


def series_file(series_id: str) -> str:
    """The prepared file of a series, relative to the store's folder."""
    return f"series/{hashlib.sha256(series_id.encode()).hexdigest()[:16]}.parquet"


def open_parquet(file: DataFile) -> pq.ParquetFile:
    """A source file, local or in an object store (its footer already checked)."""
    if isinstance(file, StorageLocation):
        return pq.ParquetFile(file.path, filesystem=file.filesystem)
    return pq.ParquetFile(str(file))


def read_unit(
    file: DataFile, unit: ReadUnit, columns: list[str], handle: pq.ParquetFile | None = None
) -> pa.Table:
    """``columns`` of one row group, with the file and row position columns appended
    (``handle``: ``file`` already open, its footer read)."""
    try:
        table = (handle or open_parquet(file)).read_row_group(unit.row_group, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        # a footer can be intact while a page inside the file is not
        raise BadInputError(
            f"Data file '{file}' cannot be read ({first_line(exc)}); write the damaged file "
            "again or leave it out of data.path."
        ) from None
    rows = np.arange(unit.first_row, unit.first_row + table.num_rows, dtype=np.int64)
    table = table.append_column(FILE_COLUMN, pa.array(np.full(len(rows), unit.file_index)))
    return table.append_column(ROW_COLUMN, pa.array(rows))


def read_batch(
    batch: pa.Table, files: list[DataFile], units: list[ReadUnit], columns: list[str]
) -> pa.Table:
    """Ray Data's read step: the row groups that ``batch``'s unit numbers name."""
    return pa.concat_tables(
        read_units(files, [units[i] for i in batch["unit"].to_pylist()], columns)
    )


def read_units(
    files: Sequence[DataFile], units: Sequence[ReadUnit], columns: list[str]
) -> Iterator[pa.Table]:
    """``read_unit`` of each of ``units`` in turn, each file's footer read once."""
    handles: dict[int, pq.ParquetFile] = {}
    for unit in units:
        if unit.file_index not in handles:
            handles[unit.file_index] = open_parquet(files[unit.file_index])
        yield read_unit(files[unit.file_index], unit, columns, handles[unit.file_index])


def prepare_series_on_ray(table: pa.Table, spec: SeriesSpec) -> pa.Table:
    """``prepare_series`` as a Ray Data task, recording the node it ran on."""
    import ray

    return prepare_series(table, spec, node=ray.get_runtime_context().get_node_id())


def prepare_series(table: pa.Table, spec: SeriesSpec, node: str | None = None) -> pa.Table:
    """Order, fill, check and write one series; returns its one row of metadata.

    The whole series is in ``table`` (it must fit one task's memory); ``node``: the Ray node
    this runs on, if any.
    """
    order = [(FILE_COLUMN, "ascending"), (ROW_COLUMN, "ascending")]
    if spec.time_column is not None:
        order.insert(0, (spec.time_column, "ascending"))
    table = table.sort_by(order)
    values = _filled(table, spec)
    rows = values.shape[0]
    series_id, key = _identity(table, spec.group_column)
    file = series_file(series_id)
    if not series_fits(rows, spec.window, spec.val_fraction):
        # No file: the driver, which sees every series, refuses them all in one line.
        no_stats = [float("nan")] * len(spec.columns)
        return _metadata(series_id, key, file, rows, 0, no_stats, no_stats, node)
    ((_, train_rows),), _ = split_rows([(0, rows)], spec.window, spec.val_fraction)
    _refuse_non_finite(values, spec.columns, spec.source)
    _refuse_beyond_float32(values, spec.columns, spec.source)
    train = values[:train_rows]
    # Two passes in float64; axis-0 reductions add row after row, whatever the alignment.
    mean = train.mean(axis=0)
    m2 = ((train - mean) ** 2).sum(axis=0)
    spec.store.child(file).write_bytes(_file_bytes(values.astype(np.float32), spec))
    return _metadata(series_id, key, file, rows, train_rows, mean.tolist(), m2.tolist(), node)


def _metadata(
    series_id: str,
    key: pa.Array | None,
    file: str,
    rows: int,
    train_rows: int,
    mean: list[float],
    m2: list[float],
    node: str | None,
) -> pa.Table:
    """A series' one row of metadata (``key``: its group value, if it has one)."""
    metadata = {
        "id": pa.array([series_id], pa.string()),
        "file": pa.array([file], pa.string()),
        "rows": pa.array([rows], pa.int64()),
        "train_rows": pa.array([train_rows], pa.int64()),
        "mean": pa.array([mean], pa.list_(pa.float64())),
        "m2": pa.array([m2], pa.list_(pa.float64())),
        "node": pa.array([node], pa.string()),
    }
    if key is not None:  # the group's own value: series are ordered by it, not by its text
        metadata["key"] = key
    return pa.table(metadata)


def _filled(table: pa.Table, spec: SeriesSpec) -> np.ndarray:
    """``[rows, columns]`` float64, gaps filled by ``spec.missing`` (``error`` refuses them)."""
    values = np.empty((table.num_rows, len(spec.columns)), dtype=np.float64)
    for k, name in enumerate(spec.columns):
        column = column_as_float(table, name, allow_missing=True)
        values[:, k] = fill_missing(column, [(0, table.num_rows)], spec.missing, name)
    return values


def _refuse_beyond_float32(values: np.ndarray, names: list[str], source: str) -> None:
    """Prepared files hold float32: a value it cannot hold would be read back as infinite."""
    bad = np.abs(values) > _FLOAT32_MAX
    if bad.any():
        row, column = divmod(int(bad.argmax()), bad.shape[1])
        raise BadInputError(
            f"Column {names[column]!r} of {source} holds {values[row, column]}, beyond the "
            f"{_FLOAT32_MAX:.1e} that prepared streaming data (float32) holds; rescale that "
            "column (e.g. divide it by a power of ten) or drop the outlying rows."
        )


def _identity(table: pa.Table, group_column: str | None) -> tuple[str, pa.Array | None]:
    """The series' id (its group value as text) and the group value itself."""
    if group_column is None:
        return NO_GROUP_ID, None
    key = table.column(group_column).combine_chunks().slice(0, 1)
    return str(key[0].as_py()), key


def _file_bytes(values: np.ndarray, spec: SeriesSpec) -> bytes:
    """The series file: row group ``j`` holds rows ``[j*R, j*R + R + window - 1)``."""
    table = pa.table(
        {name: np.ascontiguousarray(values[:, k]) for k, name in enumerate(spec.columns)}
    )
    size, overlap = spec.rows_per_group, spec.window - 1
    sink = pa.BufferOutputStream()
    # No dictionary encoding: float rows rarely repeat, and the bytes depend only on values.
    with pq.ParquetWriter(sink, table.schema, use_dictionary=False) as writer:
        for begin in range(0, table.num_rows, size):
            part = table.slice(begin, size + overlap)
            writer.write_table(part, row_group_size=part.num_rows)
    return sink.getvalue().to_pybytes()
