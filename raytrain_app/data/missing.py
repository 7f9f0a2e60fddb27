"""Filling missing values of forecasting columns within each series (``data.params.missing``).

``error`` refuses data with gaps (the default), ``ffill`` carries the last seen value forward
and ``interpolate`` draws a straight line between the values on either side of a gap. Both
fill each series (group) on its own, so no value leaks from one series into the next, and
treat rows as evenly spaced timesteps. A gap at the start of a series takes the series'
first value (``ffill``); ``interpolate`` extends the nearest value at either end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raytrain_app.errors import BadInputError

MISSING_OPTIONS = ("error", "ffill", "interpolate")


def check_missing_option(missing: object) -> None:
    """Reject an unknown ``data.params.missing``, naming the choices."""
    if missing not in MISSING_OPTIONS:
        raise BadInputError(
            f"data.params.missing must be one of {', '.join(MISSING_OPTIONS)}, got {missing!r}."
        )


def refuse_missing(values: np.ndarray, name: str) -> None:
    """The ``error`` policy: one line with the count of missing values and the option."""
    count = int((~np.isfinite(values)).sum())
    if count:
        raise BadInputError(
            f"Column {name!r} has {count} missing or non-finite value(s); set "
            "data.params.missing to ffill or interpolate to fill them, or clean the data first."
        )


def _fill_one(values: np.ndarray, how: str) -> np.ndarray:
    """One series' values with every non-finite entry filled (it has at least one finite)."""
    known = np.isfinite(values)
    if known.all():
        return values
    positions = np.arange(len(values))
    if how == "interpolate":
        return np.interp(positions, positions[known], values[known])
    # Index of the last known value at or before each row; before the first, the first.
    last = np.maximum.accumulate(np.where(known, positions, -1))
    return values[np.where(last >= 0, last, np.argmax(known))]


def fill_missing(
    values: np.ndarray, bounds: Sequence[tuple[int, int]], how: str, name: str
) -> np.ndarray:
    """``values`` (one column, ``[rows]``) with gaps filled within each series by ``how``.

    Args:
        values: float64 column with NaN where a value is missing.
        bounds: ``(begin, end)`` row range of each series, as ``group_bounds`` returns.
        how: one of ``MISSING_OPTIONS``; ``error`` raises if anything is missing.
        name: the column's name, for messages.
    """
    if how == "error":
        refuse_missing(values, name)
        return values
    if np.isfinite(values).all():
        return values
    filled = values.copy()
    for begin, end in bounds:
        part = values[begin:end]
        if not np.isfinite(part).any():
            raise BadInputError(
                f"Column {name!r} has a series with no values at all (rows {begin}-{end - 1}); "
                "data.params.missing cannot fill it: drop that series from the data."
            )
        filled[begin:end] = _fill_one(part, how)
    return filled
