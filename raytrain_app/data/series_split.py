"""The chronological train/validation cut of a series, without torch: the streaming prepare
pass runs it in Ray Data tasks, which need not import torch."""

from __future__ import annotations

from raytrain_app.errors import BadInputError


def _train_length(num_steps: int, val_fraction: float) -> int:
    """Number of leading timesteps of a series that belong to training."""
    return round(num_steps * (1.0 - val_fraction))


def _min_series_length(window: int, val_fraction: float) -> int:
    """Smallest series length that yields at least one train and one val window."""
    n = 2 * window
    while _train_length(n, val_fraction) < window or n - _train_length(n, val_fraction) < window:
        n += 1
    return n


def split_rows(
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
