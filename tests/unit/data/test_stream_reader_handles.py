"""A reader of prepared streaming data keeps its series files open between row groups: in a
bucket, opening a file costs a request of its own (S3: a HEAD for its size) before each
ranged read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from stream_data import PARAMS, prepare_here, series_table, write_files

from raytrain_app.data import stream_reader
from raytrain_app.data.stream_reader import PreparedFiles
from raytrain_app.storage import StorageLocation

ROWS_PER_GROUP = 32  # several row groups in every series but the shortest


def _groups(prepared) -> list[tuple[int, int]]:
    """(series, row group) of every row group of the prepared files."""
    root = StorageLocation.parse(prepared.location, "test")
    found = []
    for series, entry in enumerate(prepared.manifest.series):
        file = root.child(entry.file)
        count = pq.ParquetFile(file.path, filesystem=file.filesystem).num_row_groups
        found += [(series, group) for group in range(count)]
    return found


def _requests(log: Path, method: str, bucket: str) -> int:
    """Requests of ``method`` to ``bucket``'s prepared series files in moto's log."""
    return sum(f"{method} /{bucket}/" in line and "/series/" in line for line in log.open())


def test_each_series_file_is_opened_once_not_once_a_row_group(tmp_path):
    pytest.importorskip("moto", reason="the S3 test server needs moto[server] (the dev extra)")
    from raytrain_app.testing.s3_server import s3_for_this_process

    log = tmp_path / "moto.log"
    source = write_files(tmp_path / "source", series_table())
    with s3_for_this_process("stream", log_path=log) as s3:
        prepared = prepare_here(str(source), PARAMS, s3.uri("cache"), rows_per_group=ROWS_PER_GROUP)
        groups = _groups(prepared)
        files = PreparedFiles(prepared.manifest, prepared.location)
        heads, gets = _requests(log, "HEAD", "stream"), _requests(log, "GET", "stream")
        first = [files.read_group(series, group) for series, group in groups]
        again = [files.read_group(series, group) for series, group in reversed(groups)]
        heads = _requests(log, "HEAD", "stream") - heads
        gets = _requests(log, "GET", "stream") - gets
    series = len(prepared.manifest.series)
    assert len(groups) > 2 * series  # several row groups a file: the point of the test
    # Before: one HEAD for every row group read (2 * len(groups)).
    assert heads == series, (heads, series, len(groups))
    assert gets >= 2 * len(groups)  # every row group read, twice
    for ours, theirs in zip(first, reversed(again), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_beyond_the_open_files_bound_the_least_recent_is_dropped_and_reads_stay_right(
    tmp_path, monkeypatch
):
    source = write_files(tmp_path / "source", series_table())
    prepared = prepare_here(str(source), PARAMS, tmp_path / "cache", rows_per_group=ROWS_PER_GROUP)
    groups = _groups(prepared)
    expected = [PreparedFiles(prepared.manifest, prepared.location).read_group(*g) for g in groups]
    monkeypatch.setattr(stream_reader, "_OPEN_FILES", 2)
    files = PreparedFiles(prepared.manifest, prepared.location)
    # Series by series, then interleaved: every series is dropped and opened again.
    order = [*range(len(groups)), *np.argsort([g for _, g in groups], kind="stable")]
    for index in order:
        np.testing.assert_array_equal(files.read_group(*groups[index]), expected[index])
        assert len(files._handles) <= 2
