"""Standardising forecasting inputs and target with statistics of the training rows.

Columns may hold any finite float64, 1e300 included: the statistics are computed so that
they cannot overflow, and what the model would see as infinite or what it could not give
back in the target's units (float32) is refused with one line naming the column.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from raytrain_app.errors import BadInputError

# Inputs, outputs and metrics are float32 tensors: a target standard deviation or mean
# above this makes every prediction and every metric in the target's units infinite.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _stats(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column means and standard deviations; a constant column gets std 1 to avoid dividing by 0.

    A column whose plain statistics overflow (squaring a deviation of 1e200 does) is
    computed again divided by its largest magnitude, then scaled back: squaring a deviation
    of at most 2 cannot overflow, and the results (at most that magnitude) are finite.
    Other columns keep the plain computation, so ordinary data scales bit for bit as before.
    """
    if values.ndim == 1:  # one column (the target)
        mean, std = _stats(values[:, None])
        return mean[0], std[0]
    with np.errstate(over="ignore", invalid="ignore"):
        mean = values.mean(axis=0)
        std = values.std(axis=0)
    overflowed = ~(np.isfinite(mean) & np.isfinite(std))
    if overflowed.any():
        wide = values[:, overflowed]
        scale = np.abs(wide).max(axis=0)
        scale = np.where(scale > 0, scale, 1.0)
        mean[overflowed] = (wide / scale).mean(axis=0) * scale
        std[overflowed] = (wide / scale).std(axis=0) * scale
    return mean, np.where(std > 1e-12, std, 1.0)


def _standardised(values: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``(values - mean) / std`` in float64; halving first keeps the difference of two values
    near the float64 limit (1e308 and -1e308) finite, and halving is exact."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (values / 2 - mean / 2) / (std / 2)


def _first_bad(bad: np.ndarray) -> tuple[int, int]:
    """``(row, column)`` of the first True in the ``[rows, columns]`` mask ``bad``."""
    row, column = divmod(int(bad.argmax()), bad.shape[1])
    return row, column


def _refuse_non_finite(columns: np.ndarray, names: Sequence[str], source: str) -> None:
    """Every value must be finite once missing values are filled (interpolating between
    1e308 and -1e308 is not)."""
    bad = ~np.isfinite(columns)
    if bad.any():
        row, column = _first_bad(bad)
        raise BadInputError(
            f"Column {names[column]!r} of {source} holds {columns[row, column]} after its "
            f"missing values were filled; clean or rescale that column (its values are too "
            f"large to fill in between)."
        )


def _refuse_unrepresentable(scaled: np.ndarray, names: Sequence[str], source: str) -> None:
    """The model sees float32: refuse a standardised value that float32 cannot hold."""
    bad = ~(np.abs(scaled) <= _FLOAT32_MAX)
    if bad.any():
        _, column = _first_bad(bad)
        raise BadInputError(
            f"Column {names[column]!r} of {source} has values more than {_FLOAT32_MAX:.1e} "
            f"standard deviations from its training rows' mean, beyond what float32 inputs "
            f"hold; rescale that column (e.g. take its logarithm) or drop the outlying rows."
        )


def _refuse_huge_target(mean: float, std: float, name: str, source: str) -> None:
    """Predictions and metrics are ``float32 output * std + mean``: both must fit float32."""
    if max(abs(mean), std) > _FLOAT32_MAX:
        raise BadInputError(
            f"Column {name!r} of {source} is the target, and its mean {mean:.3g} or standard "
            f"deviation {std:.3g} is beyond float32's {_FLOAT32_MAX:.1e}, so predictions and "
            f"metrics in its units would be infinite; divide the target column by a power of "
            f"ten in the data."
        )


def _known_stats(known: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, float, float]:
    """A trained model's statistics, which must be finite numbers (std above 0)."""
    feature_mean = np.asarray(known["feature_mean"], dtype=np.float64)
    feature_std = np.asarray(known["feature_std"], dtype=np.float64)
    target_mean, target_std = float(known["target_mean"]), float(known["target_std"])
    stats = np.concatenate([feature_mean, feature_std, [target_mean, target_std]])
    if not (np.isfinite(stats).all() and (feature_std > 0).all() and target_std > 0):
        raise BadInputError(
            "The normalisation statistics (feature_mean, feature_std, target_mean, target_std "
            "in the checkpoint's data_info) must be finite numbers with standard deviations "
            "above 0; use the checkpoint as training wrote it."
        )
    return feature_mean, feature_std, target_mean, target_std


def standardise(
    features: np.ndarray,
    target: np.ndarray,
    train_rows: list[tuple[int, int]],
    known: Mapping[str, Any] | None = None,
    *,
    names: Sequence[str] | None = None,
    source: str = "the data",
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Standardise with statistics of the training rows only, so validation never leaks in.

    ``known`` statistics (a trained model's ``data_info``) are used as they are, so new data
    is scaled exactly as the model's training data was.

    Args:
        names: the feature columns' names, then the target's, for messages.
        source: where the data came from (``data.path 'x.parquet'``), for messages.

    Returns:
        ``inputs`` ``[rows, F + 1]`` (features, then target), the standardised target
        ``[rows]``, both float32, and the statistics as JSON-serialisable ``info`` entries.

    Raises:
        BadInputError: a non-finite value, a target too large for float32, or a value that
            standardises beyond float32's range.
    """
    columns = np.concatenate([features, target[:, None]], axis=1)
    names = list(names) if names else [f"#{k}" for k in range(features.shape[1])] + ["target"]
    _refuse_non_finite(columns, names, source)
    if known is not None:
        feature_mean, feature_std, target_mean, target_std = _known_stats(known)
    else:
        train_idx = np.concatenate([np.arange(b, e) for b, e in train_rows])
        feature_mean, feature_std = _stats(features[train_idx])
        target_mean, target_std = (float(v) for v in _stats(target[train_idx]))
        _refuse_huge_target(target_mean, target_std, names[-1], source)
    mean = np.append(feature_mean, target_mean)
    std = np.append(feature_std, target_std)
    inputs = _standardised(columns, mean, std)
    _refuse_unrepresentable(inputs, names, source)
    stats = {
        "feature_mean": [float(v) for v in feature_mean],
        "feature_std": [float(v) for v in feature_std],
        "target_mean": float(target_mean),
        "target_std": float(target_std),
    }
    return inputs.astype(np.float32), inputs[:, -1].astype(np.float32), stats
