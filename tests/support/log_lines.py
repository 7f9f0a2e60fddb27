"""The messages a logger emits, whatever raytrain's own handler does with them (it stops
propagation to the root logger, where pytest's caplog listens)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def log_lines(name: str) -> Iterator[list[str]]:
    """The INFO-and-above messages of logger ``name`` (and its children) in the block."""
    lines = LogLines()
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(lines)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield lines.messages
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
