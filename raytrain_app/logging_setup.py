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

    Ray 2.60's worker context logs "Reporting training result ..." at INFO on every report
    through a logger named after its file path (``getLogger(__file__)``), which escapes
    ``RunConfig.logging_config`` and reaches the root logger's console handler.
    """
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # a Ray without that module has no such logger either
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)
