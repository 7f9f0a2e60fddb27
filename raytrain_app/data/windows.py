"""Cutting per-row time series into chronological train/val (context, horizon) windows.

Groups (independent series) lie one after another in the rows; each is split so that its
first ``1 - val_fraction`` of timesteps are for training and no window crosses that boundary.
"""

from __future__ import annotations

import itertools
import numbers

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from raytrain_app.data.series_split import split_rows  # noqa: F401  (callers import it here)
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import CollatedBatch


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


def validate_window_settings(
    context_length: int,
    horizon: int,
    val_fraction: float,
    stride: int,
    season_length: int = 1,
) -> None:
    """Reject window settings that cannot make windows, naming the data.params key."""
    for key, value in (
        ("context_length", context_length),
        ("horizon", horizon),
        ("stride", stride),
        ("season_length", season_length),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise BadInputError(f"data.params.{key} must be an integer >= 1, got {value!r}.")
    if not isinstance(val_fraction, numbers.Real) or not 0.0 < val_fraction < 1.0:
        raise BadInputError(
            f"data.params.val_fraction must be strictly between 0 and 1, got {val_fraction!r}."
        )
    if season_length >= context_length:
        # The seasonal-naive forecast and MASE's in-sample scale look one season back.
        raise BadInputError(
            f"data.params.season_length ({season_length}) must be smaller than "
            f"data.params.context_length ({context_length}); lower the one or raise the other."
        )


def group_bounds(table: pa.Table, group_column: str | None) -> list[tuple[int, int]]:
    """``(begin, end)`` row ranges of each group in a table already sorted by group."""
    if group_column is None:
        return [(0, table.num_rows)]
    groups = table.column(group_column).to_numpy(zero_copy_only=False)
    changes = np.flatnonzero(groups[1:] != groups[:-1]) + 1
    edges = [0, *changes.tolist(), table.num_rows]
    return list(itertools.pairwise(edges))


def _window_starts(begin: int, end: int, window: int, stride: int) -> np.ndarray:
    """Row indices in ``[begin, end)`` at which a window of ``window`` rows can start."""
    return np.arange(begin, end - window + 1, stride, dtype=np.int64)


def make_dataset(
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
