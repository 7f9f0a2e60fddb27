"""The prepare pass's direct path, in this process: where the footers show the series apart
(a file per series, files sorted by series), each series is read from its own row groups,
and the store is the shuffle path's, bit for bit; interleaved series, or footers that do
not say, take the shuffle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from stream_data import (
    LENGTHS,
    PARAMS,
    ROWS_PER_GROUP,
    series_table,
    store_files,
    write_files,
    write_series_files,
)

from raytrain_app.data import stream_prepare
from raytrain_app.data.parquet_source import resolve_paths
from raytrain_app.data.stream_direct import footer_units
from raytrain_app.data.stream_prepare import prepare_stream


def prepare(source: Path, cache: Path, *, path: str = "auto", **params):
    """``prepare_stream`` in this process; ``path="shuffle"`` as if the footers did not say."""
    with pytest.MonkeyPatch.context() as patch:
        if path == "shuffle":
            patch.setattr(
                stream_prepare, "footer_units", lambda f, g: (footer_units(f, g)[0], None)
            )
        return prepare_stream(
            str(source), {**PARAMS, **params}, cache, rows_per_group=ROWS_PER_GROUP
        )


def reads_of(folder: Path, group_column: str | None = "turbine"):
    return footer_units([Path(f) for f in resolve_paths(str(folder))], group_column)


def test_a_file_per_series_is_one_read_per_series_of_its_own_row_groups(tmp_path):
    units, reads = reads_of(write_series_files(tmp_path / "src", series_table()))
    assert reads is not None and len(reads) == len(LENGTHS)
    for read in reads:
        assert len({units[i].file_index for i in read.units}) == 1 and not read.drop_shared
    # every row group of every file read once: 150 rows in 4 groups of 40, 300 in 8, ...
    assert sorted(i for read in reads for i in read.units) == list(range(len(units)))
    assert sorted(len(read.units) for read in reads) == [2, 3, 4, 8]


def test_interleaved_series_or_footers_that_do_not_say_take_the_shuffle(tmp_path):
    assert reads_of(write_files(tmp_path / "mixed", series_table()))[1] is None
    table = series_table().sort_by("turbine")
    for name, column in {
        "nulls": pa.array([None, *table.column("turbine").to_pylist()[1:]], pa.int64()),
        "floats": table.column("turbine").cast(pa.float64()),
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        pq.write_table(table.set_column(0, "turbine", column), folder / "a.parquet")
        assert reads_of(folder)[1] is None, name
    folder = tmp_path / "no-statistics"
    folder.mkdir()
    pq.write_table(table, folder / "a.parquet", row_group_size=40, write_statistics=False)
    assert reads_of(folder)[1] is None


def test_without_a_group_column_one_read_takes_every_row_group(tmp_path):
    units, reads = reads_of(write_files(tmp_path / "src", series_table()), None)
    assert [read.units for read in reads] == [tuple(range(len(units)))]


def sorted_file(folder: Path) -> Path:
    """One file sorted by series in row groups of 64 rows: most hold two series or more."""
    folder.mkdir(parents=True)
    pq.write_table(series_table().sort_by("turbine"), folder / "a.parquet", row_group_size=64)
    return folder


def series_split_over_files(folder: Path) -> Path:
    """A file per series, and series 10's rows in a second file too (shuffled rows)."""
    write_series_files(folder, series_table())
    ten = pq.read_table(folder / "turbine-10.parquet")
    pq.write_table(ten.slice(0, 120), folder / "turbine-10.parquet", row_group_size=40)
    pq.write_table(ten.slice(120), folder / "turbine-10b.parquet", row_group_size=50)
    return folder


@pytest.mark.parametrize("layout", [write_series_files, sorted_file, series_split_over_files])
def test_the_direct_path_writes_the_shuffles_bytes(tmp_path, layout):
    if layout is write_series_files:
        source = write_series_files(tmp_path / "src", series_table())
    else:
        source = layout(tmp_path / "src")
    direct = prepare(source, tmp_path / "direct")
    shuffled = prepare(source, tmp_path / "shuffle", path="shuffle")
    assert (direct.path, shuffled.path) == ("direct", "shuffle")
    assert direct.manifest.to_json() == shuffled.manifest.to_json()
    assert store_files(direct.location) == store_files(shuffled.location)
    assert [(e.id, e.rows) for e in direct.manifest.series] == [
        (str(k), v) for k, v in sorted(LENGTHS.items())
    ]


def test_a_sorted_file_reads_each_row_group_at_most_twice(tmp_path):
    """A read per row group where series begin (its own, and the rest of its last series
    in the next ones): a row group shared by two series is read by both reads."""
    units, reads = reads_of(sorted_file(tmp_path / "src"))
    counts = np.bincount([i for read in reads for i in read.units], minlength=len(units))
    assert len(reads) <= len(LENGTHS) and counts.min() == 1 and counts.max() == 2
