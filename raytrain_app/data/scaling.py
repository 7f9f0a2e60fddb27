"""Standardising forecasting inputs and target with statistics of the training rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def _stats(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column means and standard deviations; a constant column gets std 1 to avoid dividing by 0."""
    mean = values.mean(axis=0)
    std = values.std(axis=0)
    return mean, np.where(std > 1e-12, std, 1.0)


def standardise(
    features: np.ndarray,
    target: np.ndarray,
    train_rows: list[tuple[int, int]],
    known: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Standardise with statistics of the training rows only, so validation never leaks in.

    ``known`` statistics (a trained model's ``data_info``) are used as they are, so new data
    is scaled exactly as the model's training data was.

    Returns:
        ``inputs`` ``[rows, F + 1]`` (features, then target), the standardised target
        ``[rows]``, both float32, and the statistics as JSON-serialisable ``info`` entries.
    """
    if known is not None:
        feature_mean = np.asarray(known["feature_mean"], dtype=np.float64)
        feature_std = np.asarray(known["feature_std"], dtype=np.float64)
        target_mean, target_std = float(known["target_mean"]), float(known["target_std"])
    else:
        train_idx = np.concatenate([np.arange(b, e) for b, e in train_rows])
        feature_mean, feature_std = _stats(features[train_idx])
        target_mean, target_std = _stats(target[train_idx])
    scaled_target = (target - target_mean) / target_std
    inputs = np.concatenate([(features - feature_mean) / feature_std, scaled_target[:, None]], 1)
    stats = {
        "feature_mean": [float(v) for v in feature_mean],
        "feature_std": [float(v) for v in feature_std],
        "target_mean": float(target_mean),
        "target_std": float(target_std),
    }
    return inputs.astype(np.float32), scaled_target.astype(np.float32), stats
