"""Unit tests for the synthetic wind generator and the Parquet window builder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from raytrain_app.data import parquet_windows as pw
from raytrain_app.data import synthetic_wind as sw
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import collate


def _windows(path, **kwargs):
    """build_windows on the synthetic wind schema."""
    kwargs.setdefault("feature_columns", sw.FEATURE_COLUMNS)
    kwargs.setdefault("target_column", sw.TARGET_COLUMN)
    return pw.build_windows(path, **kwargs)


def _write_series(path: Path, groups: dict[str, int], *, shuffle: bool = True) -> Path:
    """Write one series per group where ``feat = 10 * t`` and ``target = t`` (t: hour index)."""
    rows = [(g, t) for g, n in groups.items() for t in range(n)]
    if shuffle:
        rows = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    t = np.array([r[1] for r in rows])
    table = pa.table(
        {
            "site": pa.array([r[0] for r in rows]),
            "time": pa.array(t.astype("datetime64[h]").astype("datetime64[s]")),
            "feat": pa.array(10.0 * t),
            "target": pa.array(t.astype(np.float64)),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def _series_kwargs(**overrides):
    kwargs = dict(
        feature_columns=["feat"],
        target_column="target",
        group_column="site",
        time_column="time",
        context_length=3,
        horizon=2,
        val_fraction=0.25,
        stride=2,
    )
    return {**kwargs, **overrides}


def _hours(dataset: pw.WindowDataset, info, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Recover the original hour indices of a window's context (from the target channel) and y."""
    x, y = dataset[index]
    mean, std = info["target_mean"], info["target_std"]
    return (x[:, -1].numpy() * std + mean).round(), (y.numpy() * std + mean).round()


# --- generator ---------------------------------------------------------------------------


def test_generate_is_deterministic_per_seed():
    a = sw.generate(num_turbines=3, num_hours=200, seed=0)
    assert a.equals(sw.generate(num_turbines=3, num_hours=200, seed=0))
    assert not a.equals(sw.generate(num_turbines=3, num_hours=200, seed=1))


def test_generate_schema_and_timestamps():
    table = sw.generate(num_turbines=2, num_hours=30, seed=0)
    assert table.num_rows == 60
    assert table.schema.field(sw.GROUP_COLUMN).type == pa.int32()
    assert table.schema.field(sw.TIME_COLUMN).type == pa.timestamp("s")
    for name in (*sw.FEATURE_COLUMNS, sw.TARGET_COLUMN):
        assert table.schema.field(name).type == pa.float32()
    times = table.column(sw.TIME_COLUMN).to_numpy()[:30]
    assert times[0] == np.datetime64("2024-01-01T00:00:00")
    assert (np.diff(times) == np.timedelta64(1, "h")).all()


def test_generate_value_ranges():
    df = sw.generate(seed=3).to_pandas()
    assert df["power"].between(0.0, 1.0).all()
    assert (df["wind_speed"] >= 0).all()
    assert np.allclose(df["wind_dir_sin"] ** 2 + df["wind_dir_cos"] ** 2, 1.0, atol=1e-5)
    assert df[list(sw.FEATURE_COLUMNS)].notna().all().all()
    # The series must vary, or there would be nothing to learn.
    assert df["power"].std() > 0.1


def test_power_curve_shape():
    speeds = np.array([0.0, 2.9, 3.0, 6.0, 9.0, 11.9, 12.0, 18.0, 25.0, 25.1, 40.0])
    power = sw.power_curve(speeds)
    assert power[:3].tolist() == [0.0, 0.0, 0.0]
    assert np.all(np.diff(power[2:7]) > 0)  # rising between cut-in and rated
    assert power[6:9].tolist() == [1.0, 1.0, 1.0]
    assert power[9:].tolist() == [0.0, 0.0]


def test_generated_power_follows_curve():
    df = sw.generate(seed=0).to_pandas()
    low = df.loc[df["wind_speed"] < sw.CUT_IN_SPEED, "power"]
    rated = df.loc[df["wind_speed"].between(12.0, 25.0), "power"]
    assert len(low) > 100 and len(rated) > 100
    assert low.mean() < 0.03 and low.max() < 0.15
    assert rated.mean() > 0.97 and rated.min() > 0.85


def test_materialize_caches(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = sw.materialize(cache, num_turbines=2, num_hours=50, seed=0)
    mtime = first.stat().st_mtime_ns
    monkeypatch.setattr(sw, "generate", lambda **_: pytest.fail("regenerated a cached table"))
    second = sw.materialize(cache, num_turbines=2, num_hours=50, seed=0)
    assert second == first and second.stat().st_mtime_ns == mtime
    monkeypatch.undo()
    other = sw.materialize(cache, num_turbines=2, num_hours=51, seed=0)
    reseeded = sw.materialize(cache, num_turbines=2, num_hours=50, seed=1)
    assert len({first, other, reseeded}) == 3
    assert {p.name for p in cache.iterdir()} == {p.name for p in (first, other, reseeded)}
    # Parquet has no seconds unit, so timestamps come back as ms; the values are unchanged.
    expected = sw.generate(num_turbines=2, num_hours=50, seed=0)
    assert pq.read_table(first).cast(expected.schema).equals(expected)


def test_generate_rejects_empty():
    with pytest.raises(ValueError, match="num_turbines"):
        sw.generate(num_turbines=0)


# --- windows -----------------------------------------------------------------------------


def test_window_counts_and_shapes(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20, "b": 24})
    splits = pw.build_windows(path, **_series_kwargs())
    # a: 15 train / 5 val rows; b: 18 / 6. Windows of 5 rows every 2 rows: (n - 5) // 2 + 1.
    assert len(splits.train) == (15 - 5) // 2 + 1 + (18 - 5) // 2 + 1 == 13
    assert len(splits.val) == 1 + 1
    x, y = splits.train[0]
    assert x.shape == (3, 2) and y.shape == (2,)
    assert x.dtype == torch.float32 and y.dtype == torch.float32
    assert splits.info["num_features"] == 2
    assert splits.info["context_length"] == 3 and splits.info["horizon"] == 2
    # Where the target's past is in x (per-window scaling reads it) and the naive season.
    assert splits.info["target_channel"] == 1 and splits.info["season_length"] == 1
    json.dumps(dict(splits.info))


def test_default_window_counts(tmp_path):
    path = sw.materialize(tmp_path, num_turbines=8, num_hours=2160, seed=0)
    splits = _windows(path, group_column=sw.GROUP_COLUMN, time_column=sw.TIME_COLUMN)
    # Per turbine: 1728 train / 432 val hours; windows of 60 hours at stride 1.
    assert len(splits.train) == 8 * (1728 - 60 + 1)
    assert len(splits.val) == 8 * (432 - 60 + 1)
    assert splits.info["num_features"] == len(sw.FEATURE_COLUMNS) + 1


def test_windows_are_sorted_contiguous_and_do_not_leak(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20, "b": 24})
    splits = pw.build_windows(path, **_series_kwargs(stride=1))
    # Group a splits at hour 15 (11 train windows), group b at hour 18.
    split_of_train_window = [15] * 11 + [18] * (18 - 5 + 1)
    assert len(splits.train) == len(split_of_train_window)
    for i, split in enumerate(split_of_train_window):
        hours = np.concatenate(_hours(splits.train, splits.info, i))
        assert (np.diff(hours) == 1).all(), "window not contiguous in time"
        assert hours.max() < split, "train window reaches into validation time"
    val_starts = []
    for i in range(len(splits.val)):
        hours = np.concatenate(_hours(splits.val, splits.info, i))
        assert (np.diff(hours) == 1).all()
        val_starts.append(hours[0])
    assert val_starts == [15, 18, 19]
    context, future = _hours(splits.train, splits.info, 0)
    assert context.tolist() == [0, 1, 2] and future.tolist() == [3, 4]


def test_normalisation_uses_train_rows_only(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20, "b": 24})
    splits = pw.build_windows(path, **_series_kwargs())
    train_hours = np.concatenate([np.arange(15), np.arange(18)])
    info = splits.info
    assert info["target_mean"] == pytest.approx(train_hours.mean())
    assert info["target_std"] == pytest.approx(train_hours.std())
    assert info["feature_mean"] == [pytest.approx(10 * train_hours.mean())]
    assert info["feature_std"] == [pytest.approx(10 * train_hours.std())]
    x, _ = splits.train[0]
    # Channel 0 is the feature, channel 1 the target's past: both standardised the same way here.
    assert torch.allclose(x[:, 0], x[:, 1], atol=1e-5)


def test_no_group_column_is_one_series(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 40}, shuffle=False)
    splits = pw.build_windows(path, **_series_kwargs(group_column=None, time_column=None))
    assert len(splits.train) == (30 - 5) // 2 + 1
    assert len(splits.val) == (10 - 5) // 2 + 1


def test_target_history_only(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20, "b": 24})
    splits = pw.build_windows(path, **_series_kwargs(feature_columns=[]))
    assert splits.train[0][0].shape == (3, 1)
    assert splits.info["num_features"] == 1 and splits.info["feature_mean"] == []


def test_directory_glob_and_list_paths(tmp_path):
    a = _write_series(tmp_path / "data" / "a.parquet", {"a": 20})
    b = _write_series(tmp_path / "data" / "nested" / "b.parquet", {"b": 24})
    expected = (13, 2)
    for path in (tmp_path / "data", str(tmp_path / "data" / "**" / "*.parquet"), [a, b]):
        splits = pw.build_windows(path, **_series_kwargs())
        assert (len(splits.train), len(splits.val)) == expected, path
    only_a = pw.build_windows(str(tmp_path / "data" / "*.parquet"), **_series_kwargs())
    assert len(only_a.train) == 6


def test_build_factory(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20, "b": 24})
    splits = pw.build({"path": str(path), **_series_kwargs()}, seed=123)
    assert len(splits.train) == 13
    again = pw.build({"path": str(path), **_series_kwargs()}, seed=7)
    assert torch.equal(splits.train[5][0], again.train[5][0])


# --- errors users see --------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["missing.parquet", "empty_dir", "*.nothing"])
def test_no_matching_files(tmp_path, pattern):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="No Parquet files match data path"):
        pw.build_windows(tmp_path / pattern, **_series_kwargs())


def test_missing_column_lists_available(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20})
    with pytest.raises(ValueError, match=r"\['nope'\] not found.*available columns: .*'feat'"):
        pw.build_windows(path, **_series_kwargs(feature_columns=["feat", "nope"]))


def test_series_too_short(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20, "b": 18})
    # Windows of 5 rows with val_fraction 0.25 need 19 rows: 14 train + 5 val.
    shorter = r"^1 of 2 series is shorter than the 19 timesteps .*: 'b' \(18 timesteps\); "
    with pytest.raises(ValueError, match=shorter + ".* drop that series"):
        pw.build_windows(path, **_series_kwargs())


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"context_length": 0}, "context_length"),
        ({"horizon": 0}, "horizon"),
        ({"stride": 0}, "stride"),
        ({"context_length": 2.5}, "context_length"),
        ({"val_fraction": "0.2"}, "val_fraction"),
        ({"season_length": 0}, "season_length"),
        ({"season_length": 3}, r"season_length \(3\)"),  # not below context_length
    ],
)
def test_invalid_window_params(tmp_path, overrides, key):
    path = _write_series(tmp_path / "s.parquet", {"a": 20})
    with pytest.raises(ValueError, match=f"data.params.{key} must"):
        pw.build_windows(path, **_series_kwargs(**overrides))
    with pytest.raises(ValueError, match=f"data.params.{key} must"):
        pw.check({"path": str(path), **_series_kwargs(**overrides)})


def test_non_numeric_and_missing_values(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20})
    with pytest.raises(ValueError, match=r"'site' of data file .*s\.parquet' has type string"):
        pw.build_windows(path, **_series_kwargs(feature_columns=["site"]))
    table = pq.read_table(path)
    feat = table.column("feat").to_numpy().copy()
    feat[3] = np.nan
    pq.write_table(table.set_column(2, "feat", pa.array(feat)), path)
    with pytest.raises(
        ValueError, match=r"'feat' has 1 missing or non-finite value\(s\); set data.params.missing"
    ):
        pw.build_windows(path, **_series_kwargs())


def test_feature_columns_must_be_a_list(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 20})
    with pytest.raises(ValueError, match="feature_columns must be a list"):
        pw.build_windows(path, **_series_kwargs(feature_columns="feat"))


def test_build_factory_errors(tmp_path):
    path = str(_write_series(tmp_path / "s.parquet", {"a": 20}))
    with pytest.raises(ValueError, match=r"Unknown data.params key\(s\) \['windw'\]"):
        pw.build({"path": path, "windw": 3, **_series_kwargs()}, seed=0)
    with pytest.raises(ValueError, match=r"data\.params\.target_column is required"):
        pw.build({"path": path, "feature_columns": ["feat"]}, seed=0)
    with pytest.raises(ValueError, match=r"needs a path \(data.path\)"):
        pw.build(_series_kwargs(), seed=0)


@pytest.mark.parametrize("damage", ["truncated", "not_parquet"])
def test_a_damaged_file_is_named(tmp_path, damage):
    path = _write_series(tmp_path / "s.parquet", {"a": 20})
    payload = path.read_bytes()
    path.write_bytes(payload[: len(payload) // 2] if damage == "truncated" else b"a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"Data file '.*s\.parquet' is not a readable Parquet"):
        pw.build_windows(path, **_series_kwargs())


def test_check_reads_every_footer_but_no_rows(tmp_path):
    _write_series(tmp_path / "a.parquet", {"a": 20})
    params = {"path": str(tmp_path / "*.parquet"), **_series_kwargs()}
    pw.check(params)  # good files pass
    table = pq.read_table(tmp_path / "a.parquet").drop_columns(["target"])
    pq.write_table(table, tmp_path / "b.parquet")  # only the second file lacks a column
    with pytest.raises(ValueError, match=r"\['target'\] not found in data file '.*b\.parquet'"):
        pw.check(params)
    with pytest.raises(ValueError, match="data.params.horizon must be an integer >= 1"):
        pw.check({**params, "horizon": 0})


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    path = _write_series(tmp_path / "s.parquet", {"a": 20})

    def denied(file):  # as pyarrow reports a file without read permission (root reads any)
        raise PermissionError(13, f"Failed to open local file '{file}'")

    monkeypatch.setattr(pw.pq, "read_schema", denied)
    with pytest.raises(ValueError, match=r"Data file '.*s\.parquet' cannot be read \(permission"):
        pw.build_windows(path, **_series_kwargs())


def _per_sample_loader(dataset, **kwargs):
    """A DataLoader that fetches and collates one sample at a time, as before __getitems__."""
    per_sample = torch.utils.data.Subset(dataset, range(len(dataset)))
    per_sample.__getitems__ = None  # the fetcher then calls __getitem__ per index
    return DataLoader(per_sample, **kwargs)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_batched_fetch_equals_per_sample_fetch(tmp_path, num_workers):
    path = _write_series(tmp_path / "s.parquet", {"a": 40, "b": 44})
    train = pw.build_windows(path, **_series_kwargs(stride=1)).train
    sampler = torch.randperm(len(train), generator=torch.Generator().manual_seed(3)).tolist()
    kwargs = dict(batch_size=4, sampler=sampler, drop_last=True, num_workers=num_workers)
    expected = list(_per_sample_loader(train, **kwargs))
    # raytrain's loaders take the gathered batch as is; a default-collate loader stacks it.
    for loader in (DataLoader(train, collate_fn=collate, **kwargs), DataLoader(train, **kwargs)):
        batches = list(loader)
        assert len(batches) == len(expected) == len(train) // 4
        for got, want in zip(batches, expected, strict=True):
            assert type(got) is type(want) is list
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and a.is_contiguous()
                assert torch.equal(a, b)


def test_batched_fetch_through_a_subset(tmp_path):
    path = _write_series(tmp_path / "s.parquet", {"a": 40})
    val = pw.build_windows(path, **_series_kwargs(stride=1, val_fraction=0.5)).val
    shard = torch.utils.data.Subset(val, range(1, len(val), 2))  # the loop's validation shard
    batch = collate(shard.__getitems__([0, 2, 1]))
    for got, want in zip(batch, default_collate([shard[0], shard[2], shard[1]]), strict=True):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- extreme values


def _write_columns(path: Path, **columns: np.ndarray) -> Path:
    pq.write_table(pa.table({name: pa.array(values) for name, values in columns.items()}), path)
    return path


_SMALL = dict(context_length=4, horizon=2, val_fraction=0.25)


def test_a_feature_near_1e300_is_standardised_instead_of_zeroed(tmp_path):
    # before: its standard deviation overflowed to inf and the model saw only zeros
    rng = np.random.default_rng(0)
    t = np.arange(40.0)
    path = _write_columns(
        tmp_path / "huge.parquet", feat=1e300 * (1 + rng.random(40)), target=np.sin(t)
    )
    splits = pw.build_windows(path, feature_columns=["feat"], target_column="target", **_SMALL)
    assert np.isfinite(splits.info["feature_mean"] + splits.info["feature_std"]).all()
    assert 1e299 < splits.info["feature_std"][0] < 1e300
    features = torch.stack([splits.train[i][0][:, 0] for i in range(len(splits.train))])
    assert torch.isfinite(features).all() and 0.5 < features.std() < 2


def _refusal(path: Path, **kwargs) -> str:
    with pytest.raises(BadInputError) as info:
        pw.build_windows(path, target_column="target", **_SMALL, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_target_float32_cannot_express_is_refused_naming_column_and_file(tmp_path):
    path = _write_columns(tmp_path / "t.parquet", feat=np.ones(40), target=1e300 * np.arange(40.0))
    message = _refusal(path, feature_columns=["feat"])
    assert message.startswith(f"Column 'target' of the Parquet data '{path}' is the target")
    assert "divide the target column by a power of ten" in message


def test_a_value_beyond_float32_after_standardising_is_refused(tmp_path):
    feat = np.concatenate([np.random.default_rng(0).random(35), np.full(5, 1e300)])
    path = _write_columns(tmp_path / "o.parquet", feat=feat, target=np.sin(np.arange(40.0)))
    message = _refusal(path, feature_columns=["feat"])
    assert message.startswith(f"Column 'feat' of the Parquet data '{path}' has values more than")
    assert "rescale that column" in message


def test_values_too_large_to_interpolate_between_are_refused(tmp_path):
    feat = np.concatenate([[1.7e308, np.nan, -1.7e308], np.ones(37)])
    path = _write_columns(tmp_path / "g.parquet", feat=feat, target=np.sin(np.arange(40.0)))
    message = _refusal(path, feature_columns=["feat"], missing="interpolate")
    assert message.startswith(f"Column 'feat' of the Parquet data '{path}' holds -inf after")


def test_non_finite_statistics_of_a_checkpoint_are_refused(tmp_path):
    path = _write_columns(tmp_path / "s.parquet", feat=np.ones(40), target=np.arange(40.0))
    stats = {"feature_mean": [0.0], "feature_std": [float("inf")], "target_mean": 0.0}
    message = _refusal(path, feature_columns=["feat"], stats={**stats, "target_std": 1.0})
    assert "feature_std" in message and "must be finite numbers" in message


def test_a_data_error_inside_a_ray_worker_reaches_the_user_as_the_same_line(tmp_path):
    """Ray Train returns a worker's exception (pickled) in ``worker_failures``; the driver
    turns it back into the error itself, which the CLI prints as one line with exit 2."""
    import pickle

    from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError

    from raytrain_app.driver.failures import user_facing_error

    path = _write_columns(tmp_path / "t.parquet", feat=np.ones(40), target=1e300 * np.ones(40))
    params = {"path": str(path), "feature_columns": ["feat"], "target_column": "target", **_SMALL}
    with pytest.raises(BadInputError) as info:
        pw.build(params, seed=0)  # what each worker's loader runs
    in_worker = pickle.loads(pickle.dumps(info.value))
    group = WorkerGroupError("worker 0 failed", {0: in_worker, 1: in_worker})
    for raised in (group, TrainingFailedError("training failed")):
        raised.__cause__ = None if raised is group else group
        error = user_facing_error(raised)
        assert isinstance(error, BadInputError) and error.exit_code == 2
        assert str(error) == str(info.value) and "\n" not in str(error)
