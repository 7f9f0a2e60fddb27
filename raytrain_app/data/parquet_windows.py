"""(context, horizon) forecasting windows over Parquet time series, as a protocol data factory.

Used for the built-in synthetic data and for users' own Parquet files alike. Each series
(one per group) is split chronologically: the first ``1 - val_fraction`` of its timesteps
are for training, the rest for validation, and no window crosses that boundary.
"""

from __future__ import annotations

import glob
import inspect
import itertools
import logging
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from raytrain_app.errors import BadInputError
from raytrain_app.protocol import CollatedBatch, DataSplits

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
)

PathLike = str | Path


class WindowDataset(Dataset):
    """Map-style dataset of ``(x, y)`` windows sliced from contiguous per-row arrays.

    Args:
        inputs: ``[rows, num_features]`` float32 standardised inputs (features, then past target).
        targets: ``[rows]`` float32 standardised target.
        starts: row index at which each window starts; groups are laid out one after another,
            so a start already encodes (group, offset in group).
        context_length: number of past rows in ``x``.
        horizon: number of future target values in ``y``.
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        starts: torch.Tensor,
        context_length: int,
        horizon: int,
    ) -> None:
        self.inputs = inputs
        self.targets = targets
        self.starts = starts
        self.context_length = context_length
        self.horizon = horizon
        # Row offsets of one window's x and y from its start, for batched gathers.
        self._x_rows = torch.arange(context_length)
        self._y_rows = torch.arange(context_length, context_length + horizon)

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``x``: ``[context_length, num_features]`` and ``y``: ``[horizon]``."""
        start = int(self.starts[index])
        end = start + self.context_length
        # Views, not copies: the DataLoader's collate makes the only copy, into the batch.
        return self.inputs[start:end], self.targets[end : end + self.horizon]

    def __getitems__(self, indices: list[int]) -> CollatedBatch:
        """The windows at ``indices`` as one batch: ``x`` ``[B, context_length, num_features]``
        and ``y`` ``[B, horizon]``, equal to stacking ``__getitem__``'s samples.

        One gather per tensor instead of a slice per sample and a stack: the DataLoader
        calls this for every batch when it exists.
        """
        starts = self.starts[torch.as_tensor(indices, dtype=torch.long)][:, None]
        return CollatedBatch(
            [self.inputs[starts + self._x_rows], self.targets[starts + self._y_rows]]
        )


def resolve_paths(path: PathLike | Sequence[PathLike]) -> list[Path]:
    """Expand a file, directory, glob or sequence of them into a sorted list of Parquet files."""
    items = [path] if isinstance(path, (str, Path)) else list(path)
    files: list[Path] = []
    for item in items:
        item_str = str(item)
        if glob.has_magic(item_str):
            files.extend(Path(p) for p in sorted(glob.glob(item_str, recursive=True)))
        elif Path(item_str).is_dir():
            files.extend(sorted(Path(item_str).rglob("*.parquet")))
        elif Path(item_str).is_file():
            files.append(Path(item_str))
    files = [f for f in files if f.is_file()]
    if not files:
        raise BadInputError(
            f"No Parquet files match data path {path!r}; give a file, a directory or a glob "
            "such as 'data/*.parquet'."
        )
    return files


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _file_schema(file: Path) -> pa.Schema:
    """The schema in a Parquet file's footer; a missing or torn footer names the file."""
    try:
        return pq.read_schema(file)
    except PermissionError:
        raise BadInputError(
            f"Data file '{file}' cannot be read (permission denied); make it readable "
            "(chmod +r) or point data.path elsewhere."
        ) from None
    except (pa.ArrowException, OSError) as exc:
        raise BadInputError(
            f"Data file '{file}' is not a readable Parquet file ({_first_line(exc)}); it may be "
            "truncated or in another format: write it again as Parquet or leave it out of "
            "data.path."
        ) from None


def check_files(
    path: PathLike | Sequence[PathLike], numeric: Sequence[str], other: Sequence[str] = ()
) -> list[Path]:
    """Resolve ``path`` and check every file's footer, columns and column types; read no rows.

    Args:
        path: as for :func:`build_windows`.
        numeric: columns that must be numeric (the features, then the target).
        other: further columns that must exist (group and time columns).

    Returns:
        The resolved Parquet files.
    """
    files = resolve_paths(path)
    for file in files:
        schema = _file_schema(file)
        missing = [c for c in dict.fromkeys([*numeric, *other]) if c not in schema.names]
        if missing:
            raise BadInputError(
                f"Column(s) {missing} not found in data file '{file}'; available columns: "
                f"{schema.names}; fix the column names in data.params or the file."
            )
        for name in numeric:
            column_type = schema.field(name).type
            if not (pa.types.is_integer(column_type) or pa.types.is_floating(column_type)):
                raise BadInputError(
                    f"Column {name!r} of data file '{file}' has type {column_type}; it must be "
                    "numeric: convert it in the file or leave it out of data.params."
                )
    return files


def _read_table(files: list[Path], columns: list[str]) -> pa.Table:
    """Read only ``columns`` from ``files`` (already checked by ``check_files``)."""
    try:
        return pads.dataset([str(f) for f in files], format="parquet").to_table(columns=columns)
    except (pa.ArrowException, OSError) as exc:
        # a footer can be intact while a page inside the file is not
        raise BadInputError(
            f"The Parquet data in data.path cannot be read ({_first_line(exc)}); write the "
            "damaged file again or leave it out of data.path."
        ) from None


def _column_as_float(table: pa.Table, name: str) -> np.ndarray:
    """One column as float64 numpy, rejecting non-numeric types and missing values."""
    column = table.column(name)
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise BadInputError(f"Column {name!r} has type {column.type}; it must be numeric.")
    values = column.to_numpy(zero_copy_only=False).astype(np.float64)
    if column.null_count or not np.isfinite(values).all():
        raise BadInputError(
            f"Column {name!r} contains missing or non-finite values; clean them first."
        )
    return values


def _group_bounds(table: pa.Table, group_column: str | None) -> list[tuple[int, int]]:
    """``(begin, end)`` row ranges of each group in a table already sorted by group."""
    if group_column is None:
        return [(0, table.num_rows)]
    groups = table.column(group_column).to_numpy(zero_copy_only=False)
    changes = np.flatnonzero(groups[1:] != groups[:-1]) + 1
    edges = [0, *changes.tolist(), table.num_rows]
    return list(itertools.pairwise(edges))


def _train_length(num_steps: int, val_fraction: float) -> int:
    """Number of leading timesteps of a series that belong to training."""
    return round(num_steps * (1.0 - val_fraction))


def _min_series_length(window: int, val_fraction: float) -> int:
    """Smallest series length that yields at least one train and one val window."""
    n = 2 * window
    while _train_length(n, val_fraction) < window or n - _train_length(n, val_fraction) < window:
        n += 1
    return n


def _window_starts(begin: int, end: int, window: int, stride: int) -> np.ndarray:
    """Row indices in ``[begin, end)`` at which a window of ``window`` rows can start."""
    return np.arange(begin, end - window + 1, stride, dtype=np.int64)


def _validate(context_length: int, horizon: int, val_fraction: float, stride: int) -> None:
    """Reject window settings that cannot make windows, naming the data.params key."""
    for key, value in (
        ("context_length", context_length),
        ("horizon", horizon),
        ("stride", stride),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise BadInputError(f"data.params.{key} must be an integer >= 1, got {value!r}.")
    if not isinstance(val_fraction, numbers.Real) or not 0.0 < val_fraction < 1.0:
        raise BadInputError(
            f"data.params.val_fraction must be strictly between 0 and 1, got {val_fraction!r}."
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


def _stats(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column means and standard deviations; a constant column gets std 1 to avoid dividing by 0."""
    mean = values.mean(axis=0)
    std = values.std(axis=0)
    return mean, np.where(std > 1e-12, std, 1.0)


def _feature_matrix(table: pa.Table, feature_columns: list[str]) -> np.ndarray:
    """``[rows, len(feature_columns)]`` float64 features; zero columns is allowed."""
    if not feature_columns:
        # The model then sees only the target's own past.
        return np.empty((table.num_rows, 0))
    return np.stack([_column_as_float(table, c) for c in feature_columns], axis=1)


def _standardise(
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
        stats: normalisation statistics to reuse (a checkpoint's ``data_info``) instead of
            computing them; ``raytrain predict`` uses this for new files.

    Returns:
        ``DataSplits`` whose ``info`` holds sizes, column names and normalisation statistics.
    """
    _validate(context_length, horizon, val_fraction, stride)
    feature_columns, keys = _column_lists(feature_columns, group_column, time_column)
    files = check_files(path, [*feature_columns, target_column], keys)
    table = _read_table(files, [*dict.fromkeys([*feature_columns, target_column, *keys])])
    if keys:
        table = table.sort_by([(k, "ascending") for k in keys])

    features = _feature_matrix(table, feature_columns)
    target = _column_as_float(table, target_column)
    window = context_length + horizon
    train_rows, val_rows = _split_rows(_group_bounds(table, group_column), window, val_fraction)
    inputs, scaled_target, stats = _standardise(features, target, train_rows, stats)
    train, val = (
        _make_dataset(inputs, scaled_target, rows, context_length, horizon, stride)
        for rows in (train_rows, val_rows)
    )
    # Debug level: this runs in every training worker.
    logger.debug("Built %d train and %d val windows", len(train), len(val))
    info = {
        "num_features": len(feature_columns) + 1,
        "context_length": int(context_length),
        "horizon": int(horizon),
        "feature_columns": feature_columns,
        "target_column": target_column,
        **stats,
    }
    return DataSplits(train=train, val=val, info=info)


def _split_rows(
    bounds: list[tuple[int, int]], window: int, val_fraction: float
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split each group's row range chronologically into train and val ranges."""
    train_rows, val_rows = [], []
    for begin, end in bounds:
        n_train = _train_length(end - begin, val_fraction)
        if n_train < window or (end - begin) - n_train < window:
            raise BadInputError(
                f"A series has {end - begin} timesteps but needs at least "
                f"{_min_series_length(window, val_fraction)} for one train and one val window "
                f"(context_length + horizon = {window}, val_fraction = {val_fraction}); "
                "lower data.params.context_length or data.params.horizon, or add data."
            )
        train_rows.append((begin, begin + n_train))
        val_rows.append((begin + n_train, end))
    return train_rows, val_rows


def _make_dataset(
    inputs: np.ndarray,
    target: np.ndarray,
    rows: list[tuple[int, int]],
    context_length: int,
    horizon: int,
    stride: int,
) -> WindowDataset:
    """Copy the given row ranges into one contiguous block and index their windows."""
    lengths = [e - b for b, e in rows]
    offsets = np.cumsum([0, *lengths[:-1]])
    window = context_length + horizon
    starts = np.concatenate(
        [_window_starts(o, o + n, window, stride) for o, n in zip(offsets, lengths, strict=True)]
    )
    part_inputs = np.concatenate([inputs[b:e] for b, e in rows])
    part_target = np.concatenate([target[b:e] for b, e in rows])
    return WindowDataset(
        torch.from_numpy(part_inputs),
        torch.from_numpy(part_target),
        torch.from_numpy(starts),
        context_length,
        horizon,
    )


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
    _validate(args["context_length"], args["horizon"], args["val_fraction"], args["stride"])
    features, keys = _column_lists(
        args["feature_columns"], args["group_column"], args["time_column"]
    )
    check_files(args["path"], [*features, args["target_column"]], keys)
