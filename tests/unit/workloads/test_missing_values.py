"""data.params.missing: refuse gaps with their count (default), or fill them within each series."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_app.data import parquet_windows as pw
from raytrain_app.data.missing import fill_missing
from raytrain_app.errors import BadInputError

NAN = np.nan
# Two series of 4 rows: a gap at the start of the first, one inside the second.
VALUES = np.array([NAN, 1.0, NAN, 3.0, 10.0, NAN, NAN, 40.0])
BOUNDS = [(0, 4), (4, 8)]


def test_ffill_carries_the_last_value_forward_within_each_series():
    filled = fill_missing(VALUES, BOUNDS, "ffill", "v")
    # The leading gap takes the series' first value; 3.0 never leaks into the second series.
    assert filled.tolist() == [1.0, 1.0, 1.0, 3.0, 10.0, 10.0, 10.0, 40.0]


def test_interpolate_draws_a_line_within_each_series():
    filled = fill_missing(VALUES, BOUNDS, "interpolate", "v")
    assert filled.tolist() == [1.0, 1.0, 2.0, 3.0, 10.0, 20.0, 30.0, 40.0]


def test_error_states_the_count_and_the_option():
    with pytest.raises(BadInputError) as info:
        fill_missing(VALUES, BOUNDS, "error", "v")
    assert str(info.value) == (
        "Column 'v' has 4 missing or non-finite value(s); set data.params.missing to ffill or "
        "interpolate to fill them, or clean the data first."
    )


def test_a_series_without_any_value_cannot_be_filled():
    values = np.array([1.0, 2.0, NAN, NAN])
    with pytest.raises(BadInputError, match=r"no values at all \(rows 2-3\)"):
        fill_missing(values, [(0, 2), (2, 4)], "ffill", "v")


def _write_with_gaps(path, n: int = 40):
    """One series with nulls in the target (3) and the feature (1)."""
    target = pa.array([None if t in (5, 6, 20) else float(t) for t in range(n)])
    feature = pa.array([None if t == 30 else 2.0 * t for t in range(n)])
    pq.write_table(pa.table({"t": np.arange(n), "feat": feature, "value": target}), path)
    return path


KWARGS = {
    "feature_columns": ["feat"],
    "target_column": "value",
    "time_column": "t",
    "context_length": 4,
    "horizon": 2,
    "val_fraction": 0.25,
}


def test_parquet_gaps_are_refused_by_default(tmp_path):
    path = _write_with_gaps(tmp_path / "gaps.parquet")
    with pytest.raises(BadInputError, match=r"'feat' has 1 missing .* data\.params\.missing"):
        pw.build_windows(path, **KWARGS)


@pytest.mark.parametrize("how", ["ffill", "interpolate"])
def test_parquet_gaps_are_filled(tmp_path, how):
    path = _write_with_gaps(tmp_path / "gaps.parquet")
    splits = pw.build_windows(path, missing=how, **KWARGS)
    x, y = splits.train[3]  # context rows 3..6, target rows 7..8
    info = splits.info
    past = x[:, -1].numpy() * info["target_std"] + info["target_mean"]
    expected = [3.0, 4.0, 4.0, 4.0] if how == "ffill" else [3.0, 4.0, 5.0, 6.0]
    assert past == pytest.approx(expected, abs=1e-4)
    assert np.isfinite(x.numpy()).all() and np.isfinite(y.numpy()).all()


def test_unknown_missing_option_is_named(tmp_path):
    path = _write_with_gaps(tmp_path / "gaps.parquet")
    with pytest.raises(BadInputError, match="data.params.missing must be one of error, ffill"):
        pw.check({"path": str(path), "missing": "drop", **KWARGS})
