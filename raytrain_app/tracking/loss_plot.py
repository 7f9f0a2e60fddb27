"""``loss.png``: train and val loss per epoch, drawn by the driver at the end of a run."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOSS_PLOT_FILE = "loss.png"


def loss_figure(rows: Sequence[Mapping[str, float]]) -> Any:
    """A matplotlib Figure of train and val loss per epoch (no pyplot: no global backend)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6, 4), dpi=100, layout="tight")
    axes = figure.add_subplot()
    epochs = [row["epoch"] for row in rows]
    for key in ("train_loss", "val_loss"):
        axes.plot(epochs, [row.get(key, math.nan) for row in rows], marker="o", label=key)
    axes.set_xlabel("epoch")
    # Rows are whole epochs: matplotlib's default ticks would add 1.5, 2.5 between them.
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("loss")
    axes.legend()
    axes.grid(alpha=0.3)
    return figure


def write_loss_plot(run_dir: Path, rows: Sequence[Mapping[str, float]]) -> Path | None:
    """Draw ``loss.png`` in ``run_dir``; without matplotlib, log how to get it and return None.

    The PNG's Description text chunk holds the plotted epochs and losses as JSON.
    """
    if not rows:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        logger.info(
            "no %s: matplotlib is not installed; pip install 'raytrain_app[plot]' to get the "
            "loss plot (or set tracking.loss_plot=false)",
            LOSS_PLOT_FILE,
        )
        return None
    path = Path(run_dir) / LOSS_PLOT_FILE
    data = {k: [row.get(k) for row in rows] for k in ("epoch", "train_loss", "val_loss")}
    tmp = path.with_name(LOSS_PLOT_FILE + ".tmp")
    try:
        loss_figure(rows).savefig(tmp, format="png", metadata={"Description": json.dumps(data)})
        os.replace(tmp, path)
    except Exception as exc:  # the run itself succeeded: never fail it over a plot
        logger.warning("could not draw %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return None
    return path
