"""Data files are data: a Parquet column whose values would be unpickled runs nothing.

Ray Data registers an Arrow extension type, ``ray.data.arrow_pickled_object``, whose
values are unpickled whenever they become Python objects (``to_pylist``, ``as_py``, Ray
Data's sort sampling, which ``groupby`` runs on the driver). Every process that imports
``ray.train`` has it registered, workers and Ray Data tasks included, and pyarrow alone
writes a file declaring it (the field metadata ``ARROW:extension:name``). Files under
``data.path`` (a shared bucket) and in a prepared store (``data.cache_dir``, shared by a
team) are written by others: such a column is refused in one line before any row is read.
The payloads only ever create a marker file.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.train  # noqa: F401  registers Ray Data's extension types, as in every worker
from stream_data import PARAMS, prepare_here, series_table, write_files

from raytrain_app.data import parquet_windows
from raytrain_app.data.stream_reader import PreparedFiles
from raytrain_app.errors import BadInputError
from raytrain_app.storage import StorageLocation

PICKLED = "ray.data.arrow_pickled_object"


class _Payload:
    """A pickle that runs a process when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickled_column(values: list, marker: Path) -> tuple[pa.Field, pa.Array]:
    """A column of pickles declared as Ray's pickled-object type, written with pyarrow
    alone as anyone could; each value keeps its text, so series stay apart."""
    field = pa.field("turbine", pa.large_binary(), metadata={"ARROW:extension:name": PICKLED})
    pickles = [pickle.dumps((str(v), _Payload(marker))) for v in values]
    return field, pa.array(pickles, pa.large_binary())


@pytest.fixture
def planted(tmp_path) -> Path:
    """Parquet series whose group column (``turbine``) holds pickled payloads."""
    table = series_table(gaps=False)
    index = table.schema.get_field_index("turbine")
    field, column = _pickled_column(table.column("turbine").to_pylist(), tmp_path / "marker")
    return write_files(tmp_path / "source", table.set_column(index, field, column))


@pytest.fixture
def unregistered(planted) -> Iterator[None]:
    """This process as a fresh driver sees it, before anything imported Ray Data: the
    column reads as its plain storage type, its extension name kept in the field."""
    registered = pq.read_schema(next(planted.glob("*.parquet"))).field("turbine").type
    assert registered.extension_name == PICKLED  # ray.train registered it
    pa.unregister_extension_type(PICKLED)
    yield
    pa.register_extension_type(registered)


def _refused(call, marker: Path) -> str:
    with pytest.raises(BadInputError) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message and not marker.exists(), message
    return message


def test_a_data_column_of_pickles_is_refused_before_any_row_is_read(planted, tmp_path):
    params = {**PARAMS, "path": str(planted)}
    marker = tmp_path / "marker"

    for call in (
        lambda: parquet_windows.check(params),  # the driver's check, before any cluster
        lambda: parquet_windows.build(params, seed=0),  # in memory (data.path)
        lambda: prepare_here(str(planted), PARAMS, tmp_path / "cache"),  # streaming
    ):
        message = _refused(call, marker)
        assert "Column 'turbine' of data file" in message and PICKLED in message, message


def test_a_driver_that_has_not_imported_ray_data_refuses_it_too(planted, tmp_path, unregistered):
    params = {**PARAMS, "path": str(planted)}
    message = _refused(lambda: parquet_windows.check(params), tmp_path / "marker")
    assert PICKLED in message, message


def test_a_prepared_file_holding_pickles_is_refused_by_the_reader(tmp_path):
    """A store's series file replaced by one of the same shape whose first column holds
    pickles (a shared ``data.cache_dir``)."""
    source = write_files(tmp_path / "source", series_table())
    prepared = prepare_here(str(source), PARAMS, tmp_path / "cache", rows_per_group=64)
    file = StorageLocation.parse(prepared.location, "test").child(prepared.manifest.series[0].file)
    original = pq.read_table(file.path)
    marker = tmp_path / "marker"
    field, column = _pickled_column(list(range(original.num_rows)), marker)
    rows_per_group = pq.ParquetFile(file.path).metadata.row_group(0).num_rows
    planted = original.set_column(0, field.with_name(original.column_names[0]), column)
    pq.write_table(planted, file.path, row_group_size=rows_per_group)
    files = PreparedFiles(prepared.manifest, prepared.location)

    message = _refused(lambda: files.read_group(0, 0), marker)

    assert "does not match its manifest" in message and "prepared again" in message, message
    assert np.isfinite(PreparedFiles(prepared.manifest, prepared.location).read_group(1, 0)).all()
