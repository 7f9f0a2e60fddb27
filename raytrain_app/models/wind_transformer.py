"""The built-in forecaster: a small Transformer encoder over the past window of features."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytrain_app.errors import BadInputError
from raytrain_app.protocol import ModelSpec, StepOutput

# Constructor arguments a config may set as model.params; the rest come from data_info.
MODEL_PARAMS = ("d_model", "nhead", "num_layers", "dim_feedforward", "dropout")


class WindTransformer(nn.Module):
    """Maps ``[batch, context_length, num_features]`` history to ``[batch, horizon]`` forecasts."""

    def __init__(
        self,
        num_features: int,
        context_length: int,
        horizon: int,
        d_model: int = 32,
        nhead: int = 4,
        num_layers: int = 2,
        dim_feedforward: int = 64,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.context_length = context_length
        self.input_proj = nn.Linear(num_features, d_model)
        self.pos_embedding = nn.Parameter(torch.empty(1, context_length, d_model))
        nn.init.normal_(self.pos_embedding, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model,
            nhead,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            batch_first=True,
            norm_first=True,
        )
        # Dropout on the [T, T] attention maps costs most of a CPU training step (the RNG is
        # slow) for little gain at this size; residual and feed-forward dropout remain.
        layer.self_attn.dropout = 0.0
        # Nested tensors only help with padding masks, and warn when combined with norm_first.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.gradient_checkpointing = False
        # Pre-norm layers leave the residual stream unnormalised; normalise it once at the end.
        self.norm = nn.LayerNorm(d_model)
        # The last token carries the most recent state, the mean the whole window's level.
        self.head = nn.Linear(2 * d_model, horizon)

    def gradient_checkpointing_enable(self) -> None:
        """Trade compute for memory (raytrain's optimizations.gradient_checkpointing hook)."""
        self.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Forecast ``horizon`` standardised target values from ``x`` of shape ``[B, T, F]``."""
        if x.shape[1] > self.context_length:
            raise ValueError(
                f"Input has {x.shape[1]} timesteps but the model was built for at most "
                f"{self.context_length}."
            )
        h = self.input_proj(x) + self.pos_embedding[:, : x.shape[1]]
        if self.gradient_checkpointing and self.training:
            # Each layer's activations are recomputed in backward instead of kept.
            for encoder_layer in self.encoder.layers:
                h = checkpoint(encoder_layer, h, use_reentrant=False)
        else:
            h = self.encoder(h)
        h = self.norm(h)
        return self.head(torch.cat([h[:, -1], h.mean(dim=1)], dim=-1))


def _unpack(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split a batch into inputs and (if present) targets."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    return batch[0], (batch[1] if len(batch) > 1 else None)


def step(module: nn.Module, batch: Any, *, target_std: float = 1.0) -> StepOutput:
    """MSE on standardised targets; ``mae`` in original units (fraction of rated power).

    Args:
        module: the (possibly wrapped) model.
        batch: ``(x, y)`` with ``x`` ``[B, T, F]`` and standardised ``y`` ``[B, horizon]``.
        target_std: standard deviation of the target, to express ``mae`` in original units.
    """
    x, y = _unpack(batch)
    # float() keeps the loss in fp32 when the forward pass ran under bf16/fp16 autocast.
    pred = module(x).float()
    loss = F.mse_loss(pred, y)
    mae = (pred.detach() - y).abs().mean() * target_std
    return StepOutput(loss=loss, num_samples=int(y.shape[0]), metrics={"mae": mae})


def predict(
    module: nn.Module, batch: Any, *, target_mean: float = 0.0, target_std: float = 1.0
) -> torch.Tensor:
    """Forecasts in original units (de-standardised) for ``batch`` = ``x`` or ``(x, ...)``."""
    x, _ = _unpack(batch)
    return module(x).float() * target_std + target_mean


def _check_params(params: Mapping[str, Any]) -> None:
    """Reject unknown or inconsistent model.params with a message naming the key."""
    for key in params:
        if key not in MODEL_PARAMS:
            raise BadInputError(
                f"Unknown key model.params.{key} for wind_transformer; "
                f"allowed keys: {', '.join(MODEL_PARAMS)}."
            )
    d_model = params.get("d_model", 32)
    nhead = params.get("nhead", 4)
    if d_model % nhead:
        raise BadInputError(
            f"model.params.d_model ({d_model}) must be divisible by model.params.nhead ({nhead})."
        )


def build(params: Mapping[str, Any], data_info: Mapping[str, Any]) -> ModelSpec:
    """Protocol model factory: ``params`` are ``MODEL_PARAMS``; sizes and stats come from data_info.

    Args:
        params: optional constructor overrides, a subset of ``MODEL_PARAMS``.
        data_info: ``DataSplits.info`` from the window builder (``num_features``,
            ``context_length``, ``horizon``, ``target_mean``, ``target_std``).
    """
    _check_params(params)
    module = WindTransformer(
        num_features=int(data_info["num_features"]),
        context_length=int(data_info["context_length"]),
        horizon=int(data_info["horizon"]),
        **params,
    )
    target_mean = float(data_info.get("target_mean", 0.0))
    target_std = float(data_info.get("target_std", 1.0))
    # partial of module-level functions, not closures, so the spec stays picklable.
    return ModelSpec(
        module=module,
        step=functools.partial(step, target_std=target_std),
        predict=functools.partial(predict, target_mean=target_mean, target_std=target_std),
    )
