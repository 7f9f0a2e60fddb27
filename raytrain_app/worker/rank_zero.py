"""Rank gating for human-facing output, in one place.

Workers call ``set_rank`` once; ``rank_zero_info`` then logs only on rank 0,
so a line appears once however many workers run.
"""

from __future__ import annotations

import logging

_rank = 0


def set_rank(rank: int) -> None:
    """Record this process's global rank (0 on the driver)."""
    global _rank
    _rank = rank


def is_rank_zero() -> bool:
    return _rank == 0


def rank_zero_info(logger: logging.Logger, msg: str, *args: object) -> None:
    if _rank == 0:
        logger.info(msg, *args)
