"""A user's own model and data (examples/sine_regression.py) train through the same path."""

from __future__ import annotations

import pytest
import torch
from paths import EXAMPLES
from torch import nn

import raytrain_app as rt

pytestmark = pytest.mark.distributed

EXAMPLE_CONFIG = EXAMPLES / "sine.yaml"


def test_example_user_package_trains_and_loads(ray_cluster, tmp_path):
    cfg = rt.load_config(EXAMPLE_CONFIG, [f"experiment.output_dir={tmp_path}"])
    result = rt.train(cfg, progress=False)
    rows = result.metrics
    assert len(rows) == cfg.train.epochs
    assert rows[-1]["val_loss"] < 0.5 * rows[0]["val_loss"]
    assert "val_mae" in rows[-1]  # the user's metric, reduced over both workers

    model = rt.load_model(result.checkpoint, config=cfg)  # the factory our config names
    assert isinstance(model, nn.Sequential)
    x = torch.linspace(-3, 3, 50).unsqueeze(1)
    error = (model(x) - torch.sin(x)).abs().mean().item()
    assert error < 0.15  # it learned the sine, not just the mean


def test_a_step_that_raises_fails_the_run_with_one_line(ray_cluster, tmp_path):
    cfg = rt.load_config(
        EXAMPLE_CONFIG,
        [
            f"experiment.output_dir={tmp_path}",
            "model.target=failing_workload:build_model_that_fails",
            "fault_tolerance.max_failures=0",
        ],
    )
    with pytest.raises(rt.RunFailedError) as info:
        rt.train(cfg, progress=False)
    message = str(info.value)
    assert "the user's step exploded" in message and "\n" not in message
    assert not (tmp_path / "sine" / "summary.json").exists()
