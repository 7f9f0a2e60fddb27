"""A small forecaster of streaming windows for the cluster tests: a linear map of the
flattened context window to the horizon, with ``sleep_s`` slowing every training step down
so that a test can act mid-run, and no randomness after initialisation."""

from __future__ import annotations

import time

from torch import nn

from raytrain_app import ModelSpec, StepOutput


def build_model(params: dict, data_info: dict) -> ModelSpec:
    inputs = int(data_info["context_length"]) * int(data_info["num_features"])
    hidden = int(params.get("hidden", 32))
    module = nn.Sequential(
        nn.Flatten(), nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, data_info["horizon"])
    )
    sleep_s = float(params.get("sleep_s", 0.0))

    def step(model: nn.Module, batch) -> StepOutput:
        x, y = batch
        if model.training and sleep_s:
            time.sleep(sleep_s)
        loss = nn.functional.mse_loss(model(x), y)
        return StepOutput(loss=loss, num_samples=y.shape[0])

    return ModelSpec(module=module, step=step)
