"""Unit tests for the built-in WindTransformer forecaster and its protocol factory."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from raytrain_app.data import parquet_windows as pw
from raytrain_app.data import synthetic_wind as sw
from raytrain_app.models import wind_transformer as wt
from raytrain_app.protocol import ModelSpec, StepOutput

INFO = {
    "num_features": 7,
    "context_length": 48,
    "horizon": 12,
    "target_mean": 0.25,
    "target_std": 0.3,
}


@pytest.fixture(scope="module")
def small_splits(tmp_path_factory):
    """Synthetic wind windows small enough to train on in a few seconds."""
    path = sw.materialize(tmp_path_factory.mktemp("wind"), num_turbines=4, num_hours=720, seed=0)
    return pw.build_windows(
        path,
        feature_columns=sw.FEATURE_COLUMNS,
        target_column=sw.TARGET_COLUMN,
        group_column=sw.GROUP_COLUMN,
        time_column=sw.TIME_COLUMN,
    )


def _stack(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole dataset as one batch."""
    return next(iter(DataLoader(dataset, batch_size=len(dataset))))


@pytest.mark.parametrize("batch_size", [1, 5])
def test_output_shape(batch_size):
    model = wt.WindTransformer(num_features=7, context_length=48, horizon=12)
    assert model(torch.randn(batch_size, 48, 7)).shape == (batch_size, 12)


def test_too_long_input_is_rejected():
    model = wt.WindTransformer(num_features=3, context_length=8, horizon=2)
    with pytest.raises(ValueError, match="at most 8"):
        model(torch.randn(2, 9, 3))


def test_build_uses_data_info_and_params():
    spec = wt.build({"d_model": 16, "nhead": 2, "num_layers": 1}, INFO)
    assert isinstance(spec, ModelSpec)
    assert spec.module.input_proj.in_features == 7
    assert spec.module.input_proj.out_features == 16
    assert len(spec.module.encoder.layers) == 1
    assert spec.module.head.out_features == 12


def test_unknown_model_param():
    with pytest.raises(ValueError, match=r"model\.params\.hidden.*allowed keys: d_model, nhead"):
        wt.build({"hidden": 64}, INFO)


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match=r"model\.params\.d_model \(30\) must be divisible"):
        wt.build({"d_model": 30}, INFO)


def test_step_loss_and_metrics():
    spec = wt.build({}, INFO)
    spec.module.eval()
    x, y = torch.randn(6, 48, 7), torch.randn(6, 12)
    out = spec.step(spec.module, (x, y))
    assert isinstance(out, StepOutput)
    pred = spec.module(x)
    assert out.num_samples == 6
    assert torch.allclose(out.loss, F.mse_loss(pred, y))
    expected_mae = (pred - y).abs().mean() * INFO["target_std"]
    assert torch.allclose(out.metrics["mae"], expected_mae)
    out.loss.backward()  # the loss is what training backpropagates


def test_predict_returns_original_units():
    spec = wt.build({}, INFO)
    spec.module.eval()
    x = torch.randn(4, 48, 7)
    standardised = spec.module(x)
    expected = standardised * INFO["target_std"] + INFO["target_mean"]
    assert torch.allclose(spec.predict(spec.module, (x, torch.zeros(4, 12))), expected)
    assert torch.allclose(spec.predict(spec.module, x), expected)


def test_spec_functions_pickle():
    spec = wt.build({}, INFO)
    step = pickle.loads(pickle.dumps(spec.step))
    assert step.keywords == {"target_std": INFO["target_std"]}
    windowed = wt.build({}, {**INFO, "target_channel": 6, "season_length": 24})
    assert pickle.loads(pickle.dumps(windowed.step)).keywords == {
        "target_std": INFO["target_std"],
        "target_channel": 6,
        "season_length": 24,
    }


def test_scaling_is_window_where_the_data_names_the_target_channel():
    """Parquet windows name x's target channel: window scaling by default. Data that does not
    (a user's factory, a checkpoint from before per-window scaling) keeps the global model,
    whose weights have the original names and shapes."""
    windowed = wt.build({}, {**INFO, "target_channel": 6})
    assert windowed.module.scaling == "window" and windowed.module.target_channel == 6
    assert windowed.module.linear.weight.shape == (12, 48)
    plain = wt.build({}, INFO)
    assert plain.module.scaling == "global" and not hasattr(plain.module, "linear")
    assert wt.build({"scaling": "global"}, {**INFO, "target_channel": 6}).module.scaling == "global"


def test_window_scaling_without_a_target_channel_is_bad_input():
    with pytest.raises(ValueError, match=r"model\.params\.scaling: window needs .*set model"):
        wt.build({"scaling": "window"}, INFO)
    with pytest.raises(ValueError, match=r"model\.params\.scaling must be one of window, global"):
        wt.build({"scaling": "local"}, {**INFO, "target_channel": 6})


def test_window_step_reports_skill_metrics():
    spec = wt.build({}, {**INFO, "target_channel": 6, "season_length": 24})
    out = spec.step(spec.module.eval(), (torch.randn(6, 48, 7), torch.randn(6, 12)))
    assert set(out.metrics) == {"mae", "mase", "persistence_mae", "seasonal_naive_mae"}


@pytest.mark.usefixtures("one_thread")
def test_training_reduces_val_loss(small_splits):
    """A few hundred AdamW steps beat the variance baseline (MSE 1 on standardised targets)."""
    torch.manual_seed(0)
    spec = wt.build({}, small_splits.info)
    model = spec.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(
        small_splits.train,
        batch_size=64,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    val_batch = _stack(small_splits.val)

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = spec.step(model, val_batch).loss.item()
        model.train()
        return loss

    initial = val_loss()
    steps = 0
    while steps < 200:
        for batch in loader:
            optimizer.zero_grad()
            spec.step(model, batch).loss.backward()
            optimizer.step()
            steps += 1
            if steps == 200:
                break
    final = val_loss()
    assert final < 0.5, f"val MSE {final:.3f} (initial {initial:.3f})"
    assert final < 0.5 * initial
    # Forecasts in original units are fractions of rated power, so close to [0, 1].
    predictions = spec.predict(model.eval(), val_batch)
    assert -0.2 < predictions.mean().item() < 1.2


# --------------------------------------------------------------------------- compile


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches and counters start empty and are dropped afterwards."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _resnet() -> torch.nn.Module:
    from raytrain_app.models.resnet_small import ResNetSmall

    return ResNetSmall(num_classes=10, widths=(8, 16), blocks_per_stage=2)


def _wind() -> torch.nn.Module:
    return wt.WindTransformer(num_features=4, context_length=12, horizon=3, dropout=0.0)


@pytest.mark.usefixtures("fresh_dynamo", "one_thread")
@pytest.mark.parametrize(
    ("make_model", "shape"),
    [(_resnet, (4, 3, 16, 16)), (_wind, (8, 12, 4))],
    ids=["resnet_small", "wind_transformer"],
)
def test_a_compiled_model_trains_with_gradient_checkpointing(make_model, shape):
    """What a GPU with compute capability >= 8 runs once the memory probe turns
    checkpointing on: torch.compile (fullgraph=False, as the product compiles) of a
    checkpointed model. ``aot_eager`` goes through AOT autograd's functionalization and
    partitioner as inductor does, without a C++ build. resnet_small's checkpoint passed
    dynamo a closure as ``context_fn`` and crashed here; the gradients and BatchNorm's
    running statistics (updated once, not again by the recomputation) must equal an
    uncompiled, uncheckpointed copy's."""
    torch.manual_seed(0)
    plain = make_model().train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    compiled = torch.compile(checkpointed, backend="aot_eager")
    for _ in range(2):  # the second call runs the cached graph
        x = torch.randn(*shape)
        plain(x).square().mean().backward()
        compiled(x).square().mean().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    for (name, expected), found in zip(
        plain.named_parameters(), checkpointed.parameters(), strict=True
    ):
        torch.testing.assert_close(found.grad, expected.grad, rtol=1e-4, atol=1e-5, msg=name)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(checkpointed.state_dict()[key], value, msg=key)
