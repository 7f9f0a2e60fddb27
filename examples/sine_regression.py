"""A complete user workload in one file: bring your own model and data to raytrain.

Train it with::

    PYTHONPATH=examples raytrain train --config examples/sine.yaml

raytrain imports the two factories named in the config (``model.target`` and
``data.target``), builds the data in every worker, wraps the model in DDP, splits the
global batch, and reports exact global loss and metrics. Nothing here knows about ranks,
devices or Ray.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

from raytrain_app import DataSplits, ModelSpec, StepOutput


def build_data(params: dict, seed: int) -> DataSplits:
    """Noisy samples of y = sin(x) on [-pi, pi]; deterministic for ``seed``.

    Called in every worker, so it must return the same data everywhere.
    """
    generator = torch.Generator().manual_seed(seed)
    n = int(params.get("num_samples", 4096))
    x = (torch.rand(n, 1, generator=generator) * 2 - 1) * math.pi
    y = torch.sin(x) + float(params.get("noise", 0.1)) * torch.randn(n, 1, generator=generator)
    split = int(0.8 * n)
    return DataSplits(
        train=TensorDataset(x[:split], y[:split]),
        val=TensorDataset(x[split:], y[split:]),
        info={"in_features": 1},  # saved in checkpoints: load_model needs no data
    )


def _step(module: nn.Module, batch) -> StepOutput:
    x, y = batch
    prediction = module(x)
    return StepOutput(
        loss=nn.functional.mse_loss(prediction, y),
        num_samples=y.shape[0],
        metrics={"mae": (prediction - y).abs().mean()},
    )


def build_model(params: dict, data_info: dict) -> ModelSpec:
    """A small MLP; ``params`` come from ``model.params`` in the config."""
    hidden = int(params.get("hidden", 64))
    module = nn.Sequential(
        nn.Linear(data_info["in_features"], hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 1),
    )
    return ModelSpec(module=module, step=_step)
