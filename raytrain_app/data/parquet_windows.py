"""(context, horizon) forecasting windows over Parquet time series, as a protocol data factory.

Used for the built-in synthetic data and for users' own Parquet files alike. Each series
(one per group) is split chronologically: the first ``1 - val_fraction`` of its timesteps
are for training, the rest for validation, and no window crosses that boundary.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

# Tests patch ``pq.read_schema`` through this module, as they could before the split.
import pyarrow.parquet as pq  # noqa: F401

from raytrain_app.data.missing import check_missing_option, fill_missing
from raytrain_app.data.parquet_source import (
    PathLike,
    check_files,
    column_as_float,
    feature_matrix,
    read_table,
    resolve_paths,
)
from raytrain_app.data.scaling import standardise
from raytrain_app.data.windows import (
    WindowDataset,
    group_bounds,
    make_dataset,
    split_rows,
    validate_window_settings,
)
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import DataSplits

# Checkpoints and configs name this module's factories; the re-exported helpers keep the
# names that were reachable here before the code moved to its own modules.
__all__ = [
    "WINDOW_PARAMS",
    "PathLike",
    "WindowDataset",
    "build",
    "build_windows",
    "check",
    "check_files",
    "resolve_paths",
]

logger = logging.getLogger(__name__)

WINDOW_PARAMS = (
    "context_length",
    "horizon",
    "val_fraction",
    "stride",
    "feature_columns",
    "target_column",
    "group_column",
    "time_column",
    "season_length",
    "missing",
)


def _column_lists(
    feature_columns: Sequence[str], group_column: str | None, time_column: str | None
) -> tuple[list[str], list[str]]:
    """The feature columns as a list, and the sort keys (group, then time) that are set."""
    if isinstance(feature_columns, str):
        raise BadInputError(
            f"data.params.feature_columns must be a list of column names, got {feature_columns!r}."
        )
    return list(feature_columns), [c for c in (group_column, time_column) if c is not None]


def _read_sorted(
    path: PathLike | Sequence[PathLike],
    feature_columns: list[str],
    target_column: str,
    keys: list[str],
) -> pa.Table:
    """Check the files, then read just the needed columns, sorted by ``keys`` when set."""
    files = check_files(path, [*feature_columns, target_column], keys)
    table = read_table(files, [*dict.fromkeys([*feature_columns, target_column, *keys])])
    if keys:
        table = table.sort_by([(k, "ascending") for k in keys])
    return table


def build_windows(
    path: PathLike | Sequence[PathLike],
    *,
    feature_columns: Sequence[str],
    target_column: str,
    group_column: str | None = None,
    time_column: str | None = None,
    context_length: int = 48,
    horizon: int = 12,
    val_fraction: float = 0.2,
    stride: int = 1,
    season_length: int = 1,
    missing: str = "error",
    stats: Mapping[str, Any] | None = None,
) -> DataSplits:
    """Build standardised train/val forecasting windows from Parquet time series.

    A sample is ``x``: ``[context_length, len(feature_columns) + 1]`` (the features, then the
    target's own past as the last channel) and ``y``: ``[horizon]``, the next target values.
    Means and standard deviations come from the training timesteps only.

    Args:
        path: a Parquet file, a directory (searched recursively), a glob, or a list of them.
        feature_columns: numeric input columns.
        target_column: numeric column to forecast.
        group_column: column identifying independent series (e.g. a turbine id), if any.
        time_column: column to sort each series by; ``None`` keeps the file order.
        context_length: past timesteps per sample.
        horizon: future timesteps to predict.
        val_fraction: trailing fraction of each series used for validation.
        stride: step between consecutive window starts.
        season_length: timesteps per season of the seasonal-naive baseline and of MASE's
            scale (1: persistence, the last value repeated).
        missing: ``error`` (refuse missing values), ``ffill`` or ``interpolate`` (fill them
            within each series; see ``raytrain_app.data.missing``).
        stats: normalisation statistics to reuse (a checkpoint's ``data_info``) instead of
            computing them; ``raytrain predict`` uses this for new files.

    Returns:
        ``DataSplits`` whose ``info`` holds sizes, column names, normalisation statistics,
        ``target_channel`` (the target's channel in ``x``) and ``season_length``.
    """
    validate_window_settings(context_length, horizon, val_fraction, stride, season_length)
    check_missing_option(missing)
    feature_columns, keys = _column_lists(feature_columns, group_column, time_column)
    table = _read_sorted(path, feature_columns, target_column, keys)
    bounds, ids = _series(table, group_column)
    features, target = _filled_columns(table, feature_columns, target_column, bounds, missing)
    train_rows, val_rows = split_rows(bounds, context_length + horizon, val_fraction, ids)
    names, source = [*feature_columns, target_column], f"the Parquet data {_shown(path)}"
    inputs, scaled_target, stats = standardise(
        features, target, train_rows, stats, names=names, source=source
    )
    train, val = (
        make_dataset(inputs, scaled_target, rows, context_length, horizon, stride)
        for rows in (train_rows, val_rows)
    )
    logger.debug("Built %d train and %d val windows", len(train), len(val))  # every worker
    shape = _window_info(feature_columns, target_column, context_length, horizon, season_length)
    return DataSplits(train=train, val=val, info={**shape, **stats})


def _window_info(
    feature_columns: list[str],
    target_column: str,
    context_length: int,
    horizon: int,
    season_length: int,
) -> dict[str, Any]:
    """The windows' shape and columns, for ``DataSplits.info`` (and checkpoints' meta)."""
    return {
        "num_features": len(feature_columns) + 1,
        "context_length": int(context_length),
        "horizon": int(horizon),
        "feature_columns": feature_columns,
        "target_column": target_column,
        # The target's own past is x's last channel: per-window scaling reads it there.
        "target_channel": len(feature_columns),
        "season_length": int(season_length),
    }


def _series(
    table: pa.Table, group_column: str | None
) -> tuple[list[tuple[int, int]], list[str] | None]:
    """Each series' rows in ``table`` (sorted by group) and its id as the streaming prepare
    pass names it, the group value as text (None without a group column)."""
    bounds = group_bounds(table, group_column)
    if group_column is None:
        return bounds, None
    firsts = table.column(group_column).take([begin for begin, _ in bounds])
    return bounds, [str(value) for value in firsts.to_pylist()]


def _shown(path: PathLike | Sequence[PathLike]) -> str:
    """The data path as the user gave it, for messages."""
    return repr(str(path)) if isinstance(path, (str, Path)) else repr([str(p) for p in path])


def _filled_columns(
    table: pa.Table,
    feature_columns: list[str],
    target_column: str,
    bounds: list[tuple[int, int]],
    missing: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Features ``[rows, F]`` and target ``[rows]`` as float64, gaps handled by ``missing``."""
    allow = missing != "error"
    features = feature_matrix(table, feature_columns, allow_missing=allow)
    for k, name in enumerate(feature_columns):
        features[:, k] = fill_missing(features[:, k], bounds, missing, name)
    target = column_as_float(table, target_column, allow_missing=allow)
    return features, fill_missing(target, bounds, missing, target_column)


def _build_arguments(params: Mapping[str, Any]) -> dict[str, Any]:
    """``build_windows``'s arguments from the factory's ``params``, defaults filled in."""
    allowed = ("path", "stats", *WINDOW_PARAMS)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise BadInputError(
            f"Unknown data.params key(s) {unknown}; allowed keys: {', '.join(allowed)}."
        )
    if params.get("path") is None:
        raise BadInputError("Parquet data needs a path (data.path): a file, a directory or a glob.")
    for key, what in (
        ("feature_columns", "a list of the numeric input columns"),
        ("target_column", "the numeric column to forecast"),
    ):
        if params.get(key) is None:
            raise BadInputError(
                f"data.params.{key} is required for Parquet data; set it to {what}."
            )
    bound = inspect.signature(build_windows).bind(**params)
    bound.apply_defaults()
    return bound.arguments


def build(params: Mapping[str, Any], seed: int) -> DataSplits:
    """Protocol data factory for Parquet files: ``params`` holds ``path`` plus ``WINDOW_PARAMS``.

    ``seed`` is unused: windows are a deterministic function of the files and params.
    """
    del seed
    return build_windows(**_build_arguments(params))


def check(params: Mapping[str, Any]) -> None:
    """Check ``params`` and the files as ``build`` would, reading only the files' footers.

    Quick enough for the driver to run before any cluster starts.
    """
    args = _build_arguments(params)
    features, keys = check_window_arguments(args)
    check_files(args["path"], [*features, args["target_column"]], keys)


def check_window_arguments(args: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Check ``build_windows``'s arguments (defaults filled in) as it would, reading no
    file; the feature columns as a list and the sort keys that are set."""
    validate_window_settings(
        args["context_length"],
        args["horizon"],
        args["val_fraction"],
        args["stride"],
        args["season_length"],
    )
    check_missing_option(args["missing"])
    return _column_lists(args["feature_columns"], args["group_column"], args["time_column"])
