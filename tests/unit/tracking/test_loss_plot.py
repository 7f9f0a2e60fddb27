"""``loss.png``'s epoch axis, drawn in this process with matplotlib's Agg canvas."""

from __future__ import annotations

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from raytrain_app.tracking.loss_plot import loss_figure


@pytest.mark.parametrize("epochs", [2, 3, 5, 40])
def test_the_epoch_axis_marks_whole_epochs_only(epochs):
    """Before: matplotlib's default ticks put 1.5, 2.5 ... on a run of 2 or 3 epochs."""
    rows = [{"epoch": e, "train_loss": 1.0 / e, "val_loss": 1.5 / e} for e in range(1, epochs + 1)]
    figure = loss_figure(rows)
    FigureCanvasAgg(figure).draw()  # ticks and their labels are settled when drawn
    axes = figure.axes[0]
    low, high = axes.get_xlim()
    shown = [t for t in axes.get_xticks() if low <= t <= high]
    assert len(shown) >= 2 and all(float(t).is_integer() for t in shown)
    labels = [label.get_text() for label in axes.get_xticklabels() if label.get_text()]
    assert labels and all(text.lstrip("−-").isdigit() for text in labels)
