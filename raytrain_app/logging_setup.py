"""One logging set-up for every entry point (CLI, driver API, Ray workers)."""

from __future__ import annotations

import logging

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Send raytrain's logs to stderr at ``level``; idempotent."""
    logger = logging.getLogger("raytrain_app")
    logger.setLevel(level)
    if not any(getattr(h, "_raytrain", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._raytrain = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    # Our handler prints; letting records reach the root logger would print them twice.
    logger.propagate = False


def quiet_ray_train_worker_logs() -> None:
    """Drop Ray Train's per-report INFO lines in a worker; warnings and errors still show.

    ``RunConfig.logging_config`` filters Ray Train's own handler, but in workers the same
    records also propagate to Ray's ``ray`` logger, which prints them at INFO.
    """
    logging.getLogger("ray.train").setLevel(logging.WARNING)
