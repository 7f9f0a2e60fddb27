"""The chronological train/validation cut of a series, without torch: the streaming prepare
pass runs it in Ray Data tasks, which need not import torch."""

from __future__ import annotations

from collections.abc import Sequence

from raytrain_app.errors import BadInputError

SHOWN_SERIES = 5  # short series a refusal names; the rest it counts


def _train_length(num_steps: int, val_fraction: float) -> int:
    """Number of leading timesteps of a series that belong to training."""
    return round(num_steps * (1.0 - val_fraction))


def _min_series_length(window: int, val_fraction: float) -> int:
    """Smallest series length that yields at least one train and one val window."""
    n = 2 * window
    while not series_fits(n, window, val_fraction):
        n += 1
    return n


def series_fits(num_steps: int, window: int, val_fraction: float) -> bool:
    """Whether a series of ``num_steps`` gives at least one train and one val window."""
    n_train = _train_length(num_steps, val_fraction)
    return n_train >= window and num_steps - n_train >= window


def refuse_short_series(
    lengths: Sequence[tuple[str | None, int]], window: int, val_fraction: float
) -> None:
    """One line naming the series too short for a train and a val window, and their count.

    Args:
        lengths: (series id, timesteps) of every series in the data's order; the id is
            None when the data is one series (no ``data.params.group_column``).
    """
    short = [(name, n) for name, n in lengths if not series_fits(n, window, val_fraction)]
    if not short:
        return
    need = _min_series_length(window, val_fraction)
    settings = f"context_length + horizon = {window}, val_fraction = {val_fraction}"
    fix = "lower data.params.context_length or data.params.horizon"
    if short[0][0] is None:
        raise BadInputError(
            f"The data (one series: data.params.group_column is unset) has {short[0][1]} "
            f"timesteps but needs at least {need} for one train and one val window "
            f"({settings}); {fix}, or add data."
        )
    shown = ", ".join(f"{name!r} ({n} timesteps)" for name, n in short[:SHOWN_SERIES])
    more = f" and {len(short) - SHOWN_SERIES} more" if len(short) > SHOWN_SERIES else ""
    verb, those = ("is", "that series") if len(short) == 1 else ("are", "those series")
    raise BadInputError(
        f"{len(short)} of {len(lengths)} series {verb} shorter than the {need} timesteps one "
        f"train and one val window need ({settings}): {shown}{more}; {fix}, drop {those}, "
        "or add data."
    )


def split_rows(
    bounds: list[tuple[int, int]],
    window: int,
    val_fraction: float,
    names: Sequence[str] | None = None,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split each group's row range chronologically into train and val ranges.

    ``names``: each group's series id, for the refusal of series too short to split
    (None: the rows are one series without an id).
    """
    ids = names if names is not None else [None] * len(bounds)
    lengths = [end - begin for begin, end in bounds]
    refuse_short_series(list(zip(ids, lengths, strict=True)), window, val_fraction)
    train_rows, val_rows = [], []
    for begin, end in bounds:
        n_train = _train_length(end - begin, val_fraction)
        train_rows.append((begin, begin + n_train))
        val_rows.append((begin + n_train, end))
    return train_rows, val_rows
