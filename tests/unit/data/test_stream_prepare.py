"""The prepare pass of streaming data, in this process (no Ray): the store it writes holds
the same windows, splits and statistics as the in-memory path, bit-stably, and is reused."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from stream_data import PARAMS, ROWS_PER_GROUP, read_windows, series_table, store_files, write_files

from raytrain_app.data.parquet_windows import build_windows
from raytrain_app.data.stream_prepare import prepare_stream
from raytrain_app.errors import BadInputError

STATS = ("feature_mean", "feature_std", "target_mean", "target_std")


def prepare(source: Path, cache: Path, **params):
    return prepare_stream(str(source), {**PARAMS, **params}, cache, rows_per_group=ROWS_PER_GROUP)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_files(tmp_path_factory.mktemp("src"), series_table())


@pytest.fixture(scope="module")
def prepared(source, tmp_path_factory):
    return prepare(source, tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("missing", ["ffill", "interpolate"])
def test_windows_splits_and_stats_equal_the_in_memory_paths(source, tmp_path, missing):
    result = prepare(source, tmp_path, missing=missing)
    manifest = result.manifest
    assert [e.id for e in manifest.series] == ["2", "3", "7", "10"]  # numeric order
    assert [e.rows for e in manifest.series] == [50, 150, 90, 300]
    # one series in one row group, one in several
    assert {s: int((manifest.chunks("train").series == s).sum()) for s in (0, 3)} == {0: 1, 3: 4}
    memory = build_windows(str(source), **{**PARAMS, "missing": missing})
    for split in ("train", "val"):
        # read_windows checks every window lies in its series, its split and its row group
        x, y, _ = read_windows(manifest, result.location, split)
        dataset = getattr(memory, split)
        assert manifest.chunks(split).num_windows == len(dataset) == len(x)
        x_mem, y_mem = dataset.__getitems__(list(range(len(dataset)))).fields
        np.testing.assert_allclose(x, x_mem.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y, y_mem.numpy(), rtol=1e-5, atol=1e-6)
    info = manifest.info()
    for name in STATS:
        np.testing.assert_allclose(info[name], memory.info[name], rtol=1e-12)
    assert {k: info[k] for k in info if k not in STATS} == {
        k: memory.info[k] for k in info if k not in STATS
    }


def test_a_second_call_reuses_the_store_and_writes_nothing(source, prepared, tmp_path, caplog):
    cache = Path(prepared.location).parent
    files = sorted(Path(prepared.location).rglob("*"))
    before = {f: os.stat(f).st_mtime_ns for f in files}
    with caplog.at_level("INFO", logger="raytrain_app"):
        again = prepare(source, cache)
    assert again.reused and again.nodes == ()
    assert again.manifest.to_json() == prepared.manifest.to_json()
    assert again.location == prepared.location
    assert {f: os.stat(f).st_mtime_ns for f in sorted(Path(prepared.location).rglob("*"))} == before
    assert f"reused prepared data in {prepared.location}" in caplog.text


def test_two_fresh_prepares_write_the_same_bytes(source, prepared, tmp_path):
    again = prepare(source, tmp_path)
    assert not again.reused and Path(again.location).name == Path(prepared.location).name
    first = store_files(prepared.location)
    assert "manifest.json" in first and len(first) == 5
    assert store_files(again.location) == first


def test_other_files_or_params_give_another_key(source, prepared, tmp_path):
    key = Path(prepared.location).name
    copy = write_files(tmp_path / "src", series_table())  # the same rows in other files
    assert Path(prepare(copy, tmp_path / "c1").location).name != key
    assert Path(prepare(source, tmp_path / "c2", stride=3).location).name != key


def test_a_rewritten_source_file_gives_a_new_key_and_store(tmp_path):
    source = write_files(tmp_path / "src", series_table())
    first = prepare(source, tmp_path / "cache")
    write_files(source, series_table(seed=1))
    second = prepare(source, tmp_path / "cache")
    assert not second.reused and second.location != first.location


def refusals(source: Path, cache: Path, **params) -> tuple[str, str]:
    """The one-line errors of the prepare pass and of the in-memory path on ``source``."""
    with pytest.raises(BadInputError) as streamed:
        prepare(source, cache, **params)
    with pytest.raises(BadInputError) as in_memory:
        build_windows(str(source), **{**PARAMS, **params})
    assert not list(cache.rglob("manifest.json"))
    return str(streamed.value), str(in_memory.value)


def test_too_short_series_are_named_and_counted_as_in_memory(tmp_path):
    lengths = {1: 100, 2: 20, 3: 45, **dict.fromkeys(range(10, 16), 10)}
    source = write_files(tmp_path / "src", series_table(lengths=lengths))
    streamed, in_memory = refusals(source, tmp_path / "cache")
    assert streamed == in_memory
    assert streamed.startswith(
        "8 of 9 series are shorter than the 46 timesteps one train and one val window need "
        "(context_length + horizon = 12, val_fraction = 0.25): '2' (20 timesteps), "
        "'3' (45 timesteps), '10' (10 timesteps), '11' (10 timesteps), '12' (10 timesteps) "
        "and 3 more; "
    ), streamed
    assert "\n" not in streamed and "data.params.context_length" in streamed


def test_data_without_a_group_column_too_short_for_a_window_is_one_series(tmp_path):
    table = series_table(lengths={5: 20}, gaps=False).drop_columns(["turbine", "hour"])
    source = write_files(tmp_path / "src", table)
    params = {"group_column": None, "time_column": None}
    streamed, in_memory = refusals(source, tmp_path / "cache", **params)
    assert streamed == in_memory
    assert streamed.startswith(
        "The data (one series: data.params.group_column is unset) has 20 timesteps but needs "
        "at least 46 for one train and one val window"
    ), streamed


def test_missing_values_with_missing_error_are_refused_with_the_existing_line(source, tmp_path):
    with pytest.raises(BadInputError) as error:
        prepare(source, tmp_path, missing="error")
    assert "\n" not in str(error.value)
    assert "missing or non-finite value(s); set data.params.missing to ffill or interpolate" in str(
        error.value
    )
    assert not list(tmp_path.rglob("manifest.json"))


def test_a_column_named_twice_is_refused(source, tmp_path):
    with pytest.raises(BadInputError, match="name a column twice"):
        prepare(source, tmp_path, feature_columns=["wind", "power"])


def test_without_group_and_time_columns_the_data_is_one_series_in_file_order(tmp_path):
    table = series_table(lengths={5: 200}, gaps=False)
    source = write_files(tmp_path / "src", table.drop_columns(["turbine", "hour"]))
    params = {"group_column": None, "time_column": None}
    result = prepare(source, tmp_path / "cache", **params)
    assert [(e.id, e.rows, e.train_rows) for e in result.manifest.series] == [("all", 200, 150)]
    memory = build_windows(str(source), **{**PARAMS, **params})
    x, _, _ = read_windows(result.manifest, result.location, "train")
    x_mem, _ = memory.train.__getitems__(list(range(len(memory.train)))).fields
    np.testing.assert_allclose(x, x_mem.numpy(), rtol=1e-5, atol=1e-6)  # rows not re-sorted
