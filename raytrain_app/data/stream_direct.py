"""The prepare pass's direct path: series read from their own row groups, no shuffle.

The footers' statistics of the group column say where each series can be: a row group
whose min equals its max holds one series; row groups whose ranges do not overlap (a file,
or files, sorted by series) hold each series in a run of consecutive row groups. Where
every row group's range is known and no two overlap, each series is prepared by one task
that reads only its row groups (``GroupRead``), and nothing moves between tasks. Where
ranges overlap (interleaved series), a statistic is missing, the group column holds nulls
or floats, the pass shuffles instead (``stream_ray``). Both give the same files: a series'
rows are the same rows either way, and ``prepare_series`` orders them itself.

Correctness rests on the footers' min and max being bounds of the column, as the Parquet
format defines them; they need not be exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raytrain_app.data.parquet_source import DataFile
from raytrain_app.data.stream_series import (
    ReadUnit,
    SeriesSpec,
    open_parquet,
    prepare_series,
    read_units,
)
from raytrain_app.data.windows import group_bounds


@dataclass(frozen=True)
class GroupRead:
    """The row groups one direct task reads, as indices into the pass's list of units.

    The first is the task's own: its rows, less its smallest value when ``drop_shared``
    (that series began in an earlier row group and is the task before's). The others
    continue the task's last series: only their smallest value's rows are the task's.
    """

    units: tuple[int, ...]
    drop_shared: bool = False


@dataclass(frozen=True)
class _Range:
    """A row group's footer statistics of the group column."""

    low: Any
    high: Any
    unit: int


def footer_units(
    files: Sequence[DataFile], group_column: str | None
) -> tuple[list[ReadUnit], list[GroupRead] | None]:
    """Every row group of ``files`` as a unit, and the direct path's reads where the
    footers allow one (None: the series are interleaved, or the statistics do not say).

    Reads footers only; what is kept is one small tuple per row group."""
    units: list[ReadUnit] = []
    ranges: list[_Range] | None = []
    for index, file in enumerate(files):
        metadata = open_parquet(file).metadata
        column = _column_index(metadata, group_column)
        first = 0
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            if rows:  # an empty row group holds no series and may have no statistics
                if ranges is not None and column is not None:
                    found = _range(metadata.row_group(group).column(column), len(units))
                    ranges = None if found is None else [*ranges, found]
                units.append(ReadUnit(index, group, first, rows))
            first += rows
    if group_column is None:  # one series: one task reads every row group
        return units, [GroupRead(tuple(range(len(units))))] if units else []
    return units, None if ranges is None else _group_reads(ranges)


def _column_index(metadata: pq.FileMetaData, name: str | None) -> int | None:
    if name is None:
        return None
    names = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
    return names.index(name) if name in names else None


def _range(column: pq.ColumnChunkMetaData, unit: int) -> _Range | None:
    """The row group's [min, max] of the group column: None where it is unknown, where
    nulls are (a null series), or for floats (NaN is in no statistic)."""
    stats = column.statistics
    if stats is None or not stats.has_min_max or not stats.has_null_count:
        return None
    if stats.null_count or column.physical_type in ("FLOAT", "DOUBLE"):
        return None
    return _Range(stats.min, stats.max, unit)


def _group_reads(ranges: list[_Range]) -> list[GroupRead] | None:
    """Row groups in the order of their ranges, each starting a task or continuing one;
    None where two ranges overlap (a series may then be anywhere)."""
    try:
        ranges = sorted(ranges, key=lambda r: (r.low, r.high, r.unit))
    except TypeError:  # statistics of types Python does not order
        return None
    reads: list[list[int]] = []
    shared: list[bool] = []
    high = None
    for found in ranges:
        if high is not None and found.low < high:
            return None  # interleaved: the shuffle gathers each series
        if high is not None and found.low == high:
            reads[-1].append(found.unit)  # the last task's series goes on here
            if found.high == found.low:
                continue
        reads.append([found.unit])
        shared.append(high is not None and found.low == high)
        high = found.high
    return [GroupRead(tuple(units), drop) for units, drop in zip(reads, shared, strict=True)]


def read_group(
    files: Sequence[DataFile],
    units: Sequence[ReadUnit],
    read: GroupRead,
    columns: list[str],
    group_column: str | None,
) -> pa.Table:
    """The rows of the series ``read`` is for, sorted by series (stably: files' order kept)."""
    parts = []
    tables = read_units(files, [units[i] for i in read.units], columns)
    for position, table in enumerate(tables):
        if group_column is not None and (position or read.drop_shared):
            keys = table.column(group_column)
            same = pc.equal(keys, pc.min(keys))
            table = table.filter(pc.invert(same) if position == 0 else same)
        parts.append(table)
    table = pa.concat_tables(parts)
    if group_column is None or table.num_rows == 0:
        return table
    bounds = pc.min_max(table.column(group_column))
    if bounds["min"] == bounds["max"]:  # one series, the common case: no copy to sort
        return table
    return table.sort_by([(group_column, "ascending")])


def prepare_read(
    files: Sequence[DataFile],
    units: Sequence[ReadUnit],
    read: GroupRead,
    spec: SeriesSpec,
    columns: list[str],
    node: str | None = None,
) -> list[pa.Table]:
    """Every series of one direct read prepared: their rows of metadata (none where the
    statistics bounded values that no row holds)."""
    table = read_group(files, units, read, columns, spec.group_column)
    if table.num_rows == 0:
        return []
    bounds = group_bounds(table, spec.group_column)
    return [prepare_series(table.slice(b, e - b), spec, node=node) for b, e in bounds]


def prepare_reads_on_ray(
    batch: pa.Table,
    files: Sequence[DataFile],
    units: Sequence[ReadUnit],
    reads: Sequence[GroupRead],
    spec: SeriesSpec,
    columns: list[str],
) -> pa.Table:
    """The direct path's Ray Data task: the reads ``batch``'s numbers name, prepared."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    parts = [
        part
        for i in batch["read"].to_pylist()
        for part in prepare_read(files, units, reads[i], spec, columns, node)
    ]
    return pa.concat_tables(parts) if parts else pa.table({"rows": pa.array([], pa.int64())})
