"""Forecasts with skill: per-window scaling follows a trend out of the training range, a
real series is forecast better than persistence, and the skill metrics are what they say."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from loop_harness import LocalSession, run_loop, worker_task
from torch.utils.data import DataLoader

from raytrain_app.config import config_from_dict
from raytrain_app.data import parquet_windows as pw
from raytrain_app.models import wind_transformer as wt

SMALL_MODEL = {"d_model": 16, "nhead": 2, "num_layers": 1, "dim_feedforward": 32}


def _write(path, values: np.ndarray):
    pq.write_table(pa.table({"t": np.arange(len(values)), "value": values}), path)
    return path


def _train(spec, dataset, steps: int, lr: float = 3e-3) -> None:
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(spec.module.parameters(), lr=lr)
    loader = DataLoader(
        dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    spec.module.train()
    done = 0
    while done < steps:
        for batch in loader:
            optimizer.zero_grad()
            spec.step(spec.module, batch).loss.backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    spec.module.eval()


@pytest.mark.usefixtures("one_thread")
def test_window_scaling_follows_a_trend_above_the_training_range(tmp_path):
    """A noisy ramp: every validation target lies above the training maximum, and so do the
    forecasts, within noise of the truth (a globally scaled model, the same way trained,
    stays near the training maximum: 16 off on average)."""
    rng = np.random.default_rng(0)
    values = 0.5 * np.arange(240) + rng.normal(0.0, 1.0, 240)
    path = _write(tmp_path / "ramp.parquet", values)
    splits = pw.build_windows(
        path,
        feature_columns=[],
        target_column="value",
        time_column="t",
        context_length=24,
        horizon=6,
        val_fraction=0.25,
    )
    train_max = values[:180].max()
    spec = wt.build(SMALL_MODEL, splits.info)
    _train(spec, splits.train, steps=150)
    with torch.no_grad():
        x, y = next(iter(DataLoader(splits.val, batch_size=len(splits.val))))
        forecast = spec.predict(spec.module, x)
    truth = y * splits.info["target_std"] + splits.info["target_mean"]
    assert truth.min() > train_max
    assert forecast.min() > train_max, f"lowest forecast {forecast.min():.1f} <= {train_max:.1f}"
    # Near the truth too, not merely above the line: within a few noise widths.
    assert (forecast - truth).abs().mean() < 3.0


@pytest.mark.usefixtures("one_thread")
def test_a_real_series_is_forecast_better_than_persistence(tmp_path):
    """Yearly sunspot numbers (bundled with statsmodels), trained by the worker loop in this
    process: the model's validation MAE beats persistence's on the same windows."""
    from statsmodels.datasets import sunspots as bundled  # the dev extra installs it

    sunspots = bundled.load_pandas().data
    path = _write(tmp_path / "sunspots.parquet", sunspots["SUNACTIVITY"].to_numpy(float))
    raw = {
        "experiment": {"name": "sunspots", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"name": "wind_transformer", "params": SMALL_MODEL},
        "data": {
            "path": str(path),
            "params": {
                "feature_columns": [],
                "target_column": "value",
                "time_column": "t",
                "context_length": 24,
                "horizon": 4,
                "val_fraction": 0.25,
                "season_length": 11,
            },
        },
        "train": {"epochs": 12, "global_batch_size": 32, "lr": 3e-3, "checkpoint_every_epochs": 12},
        "scaling": {"num_workers": 1},
        "dataloader": {"num_workers": 0},
        "tracking": {"tensorboard": False, "loss_plot": False},
    }
    cfg = config_from_dict(raw)
    run_dir = tmp_path / "runs" / "sunspots"
    result, _ = run_loop(worker_task(cfg, run_dir), LocalSession(run_dir / "session"))
    final = result["history"][-1]
    assert {"val_mase", "val_persistence_mae", "val_seasonal_naive_mae"} <= final.keys()
    assert final["val_mae"] < 0.7 * final["val_persistence_mae"], final
    assert final["val_mae"] < final["val_seasonal_naive_mae"], final
    assert final["val_mase"] < 1.0  # better than the seasonal-naive forecast in sample


def test_skill_metrics_on_a_hand_made_batch():
    """Persistence repeats the last value, seasonal naive the last season; MASE divides each
    window's MAE by its context's in-sample seasonal-naive MAE."""
    past = torch.tensor([[0.0, 1.0, 0.0, 1.0], [2.0, 2.0, 4.0, 4.0]])
    y = torch.tensor([[0.0, 1.0, 0.0], [4.0, 4.0, 4.0]])
    window_mae = torch.tensor([0.5, 1.0])
    metrics = wt.skill_metrics(past, y, window_mae, season_length=2, target_std=10.0)
    # persistence: |1-0|,|1-1|,|1-0| -> 2/3 and 0 -> mean 1/3, times target_std
    assert metrics["persistence_mae"].item() == pytest.approx(10.0 / 3)
    # seasonal naive (0, 1, 0) and (4, 4, 4): exact
    assert metrics["seasonal_naive_mae"].item() == pytest.approx(0.0)
    # in-sample: |0-0|,|1-1| -> 0 (floored) and |4-2|,|4-2| -> 2
    expected = (0.5 / wt.MIN_MASE_SCALE + 1.0 / 2.0) / 2
    assert metrics["mase"].item() == pytest.approx(expected)
    assert "seasonal_naive_mae" not in wt.skill_metrics(past, y, window_mae, 1, 1.0)


def test_window_forecasts_shift_with_the_series():
    """In the window frame a level shift of the target's past shifts the forecast by as much:
    the network never sees absolute levels."""
    torch.manual_seed(0)
    model = wt.WindTransformer(num_features=3, context_length=8, horizon=2, **SMALL_MODEL)
    torch.nn.init.normal_(model.linear.weight, std=0.1)  # it starts at zero
    model.eval()
    x = torch.randn(4, 8, 3)
    shifted = x.clone()
    shifted[..., -1] += 5.0
    with torch.no_grad():
        assert torch.allclose(model(shifted), model(x) + 5.0, atol=1e-4)
