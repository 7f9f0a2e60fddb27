"""Parquet files whose column types differ are refused in one line naming the file and the
column, on every path that reads them: in memory, the streaming prepare pass in this
process (``train --local``, ``predict --input``) and on Ray (refused on the driver, before
any task starts). The exit code and the CLI's one line are in
``tests/unit/api/test_bad_input_table.py`` (``type_drift_*``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from stream_data import PARAMS

from raytrain_app.data import stream_prepare
from raytrain_app.data.parquet_source import check_files
from raytrain_app.data.parquet_windows import build_windows
from raytrain_app.errors import BadInputError


def write_series(path: Path, turbine: int, power_type: pa.DataType) -> None:
    hours = np.arange(120)
    table = pa.table(
        {
            "turbine": np.full(120, turbine),
            "hour": hours,
            "wind": np.sin(hours / 7.0),
            "temp": np.cos(hours / 5.0),
            "power": pa.array(hours % 9).cast(power_type),
        }
    )
    pq.write_table(table, path)


@pytest.fixture
def drifting(tmp_path) -> Path:
    """Two files: ``power`` is int64 in ``a.parquet`` and double in ``b.parquet``."""
    source = tmp_path / "src"
    source.mkdir()
    write_series(source / "a.parquet", 1, pa.int64())
    write_series(source / "b.parquet", 2, pa.float64())
    return source


def _in_memory(source: Path, cache: Path) -> None:
    build_windows(str(source), **PARAMS)


def _prepare(source: Path, cache: Path) -> None:
    stream_prepare.prepare_stream(str(source), PARAMS, cache)


def _prepare_on_ray(source: Path, cache: Path) -> None:
    """The Ray branch of the prepare pass, with a stand-in for Ray that fails if reached."""

    def no_task(*args, **kwargs):
        raise AssertionError("a Ray task started on drifting files")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_prepare, "_ray_initialized", lambda: True)
        patch.setattr(stream_prepare, "_run_on_ray", no_task)
        _prepare(source, cache)


@pytest.mark.parametrize(
    "path", [_in_memory, _prepare, _prepare_on_ray], ids=["in_memory", "in_process", "ray"]
)
def test_a_type_drift_is_one_line_naming_the_file_in_every_path(drifting, tmp_path, path):
    with pytest.raises(BadInputError) as error:
        path(drifting, tmp_path / "cache")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        f"Column 'power' is double in data file '{drifting / 'b.parquet'}' but int64 in "
        f"'{drifting / 'a.parquet'}';"
    ), message
    assert "same type" in message and "cast" in message
    assert not list((tmp_path / "cache").rglob("*.parquet"))  # nothing prepared


def test_a_drift_in_a_column_the_run_does_not_read_is_no_drift(tmp_path):
    """Only the columns named in data.params must agree: others are never read."""
    write_series(tmp_path / "a.parquet", 1, pa.float64())
    write_series(tmp_path / "b.parquet", 2, pa.float64())
    extra = pq.read_table(tmp_path / "b.parquet").append_column("note", pa.array(["x"] * 120))
    pq.write_table(extra, tmp_path / "b.parquet")
    first = pq.read_table(tmp_path / "a.parquet").append_column("note", pa.array([1] * 120))
    pq.write_table(first, tmp_path / "a.parquet")
    assert len(check_files(str(tmp_path), ["wind", "temp", "power"], ["turbine", "hour"])) == 2


def test_a_drift_in_the_group_column_names_it(tmp_path):
    write_series(tmp_path / "a.parquet", 1, pa.float64())
    write_series(tmp_path / "b.parquet", 2, pa.float64())
    table = pq.read_table(tmp_path / "b.parquet")
    ids = table.column("turbine").cast(pa.string())
    pq.write_table(table.set_column(0, "turbine", ids), tmp_path / "b.parquet")
    with pytest.raises(BadInputError, match=r"^Column 'turbine' is string in data file .*b\.parq"):
        check_files(str(tmp_path), ["wind", "temp", "power"], ["turbine", "hour"])
