"""The small forecaster of the streaming benchmark: the shape of the cluster tests'
``window_regression`` (a linear map of the flattened context window to the horizon through
one tanh layer), without its test-only sleep. So small that a step costs about a
millisecond: whatever the data path costs shows in the throughput.
"""

from __future__ import annotations

from torch import nn

from raytrain_app import ModelSpec, StepOutput

HIDDEN = 32


def build_model(params: dict, data_info: dict) -> ModelSpec:
    """Protocol model factory (``model.target: benchmarks.window_model:build_model``)."""
    inputs = int(data_info["context_length"]) * int(data_info["num_features"])
    hidden = int(params.get("hidden", HIDDEN))
    module = nn.Sequential(
        nn.Flatten(), nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, data_info["horizon"])
    )

    def step(model: nn.Module, batch) -> StepOutput:
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return StepOutput(loss=loss, num_samples=y.shape[0])

    return ModelSpec(module=module, step=step)
