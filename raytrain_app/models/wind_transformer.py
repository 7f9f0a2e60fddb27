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
MODEL_PARAMS = ("d_model", "nhead", "num_layers", "dim_feedforward", "dropout", "scaling")
SCALING_OPTIONS = ("window", "global")
# Smallest per-window scale, in standard deviations of the training target: a window quieter
# than the series as a whole keeps the series' scale, since its own small spread says little
# about how far the next steps may move (a calm turbine can ramp up to rated power). On the
# quickstart a floor of 0.1 made val_loss 18-29 % worse than global scaling, 0.3 about even.
MIN_WINDOW_SCALE = 1.0


class WindTransformer(nn.Module):
    """Maps ``[batch, context_length, num_features]`` history to ``[batch, horizon]`` forecasts.

    Inputs and outputs are in the data's global standardised units. With ``scaling="window"``
    (the default) the network works in each sample's own frame: the target's past (channel
    ``target_channel`` of ``x``) is shifted by its context mean and divided by its context
    standard deviation (at least ``MIN_WINDOW_SCALE``), the network forecasts in that frame,
    and the forecast is mapped back, so it can leave the range of levels it was trained on.
    The frame's level is deliberately not an input: with it the network learns absolute
    levels again. A linear map from the scaled past to the forecast is added to the
    transformer's: short series are mostly linear, and the transformer learns the rest.
    ``scaling="global"`` is the original model, without either.
    """

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
        scaling: str = "window",
        target_channel: int = -1,
    ) -> None:
        super().__init__()
        if scaling not in SCALING_OPTIONS:
            raise ValueError(f"scaling must be one of {SCALING_OPTIONS}, got {scaling!r}")
        self.context_length = context_length
        self.scaling = scaling
        self.target_channel = target_channel % num_features
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
        if scaling == "window":
            # Starts at zero: the forecast starts as the transformer's alone.
            self.linear = nn.Linear(context_length, horizon)
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)

    def gradient_checkpointing_enable(self) -> None:
        """Trade compute for memory (raytrain's optimizations.gradient_checkpointing hook)."""
        self.gradient_checkpointing = True

    def window_frame(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` with the target's past in its window's frame, and the frame's ``loc`` and
        ``scale`` (each ``[B, 1]``, fp32, in global standardised units)."""
        c = self.target_channel
        past = x[..., c].float()
        loc = past.mean(dim=1, keepdim=True)
        scale = past.std(dim=1, correction=0, keepdim=True).clamp_min(MIN_WINDOW_SCALE)
        scaled = ((past - loc) / scale).to(x.dtype)
        return torch.cat([x[..., :c], scaled[..., None], x[..., c + 1 :]], dim=-1), loc, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Forecast ``horizon`` standardised target values from ``x`` of shape ``[B, T, F]``."""
        if x.shape[1] > self.context_length:
            raise ValueError(
                f"Input has {x.shape[1]} timesteps but the model was built for at most "
                f"{self.context_length}."
            )
        if self.scaling == "global":
            return self._encode(x)
        x, loc, scale = self.window_frame(x)
        # A shorter input than context_length meets the weights of the most recent steps.
        weight = self.linear.weight[:, -x.shape[1] :]
        linear = F.linear(x[..., self.target_channel], weight, self.linear.bias)
        return (self._encode(x) + linear).float() * scale + loc

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """The network itself: ``[B, T, F]`` inputs to ``[B, horizon]`` outputs."""
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


# Floor of MASE's in-sample scale, in target standard deviations: a context without any
# change would otherwise divide by zero.
MIN_MASE_SCALE = 1e-3


def step(
    module: nn.Module,
    batch: Any,
    *,
    target_std: float = 1.0,
    target_channel: int | None = None,
    season_length: int = 1,
) -> StepOutput:
    """MSE on standardised targets; ``mae`` in original units (fraction of rated power).

    With ``target_channel`` (where ``x`` holds the target's past) the metrics also give the
    model's skill against naive forecasts of the same windows: ``mase`` and the naive
    forecasts' MAE (see ``skill_metrics``).

    Args:
        module: the (possibly wrapped) model.
        batch: ``(x, y)`` with ``x`` ``[B, T, F]`` and standardised ``y`` ``[B, horizon]``.
        target_std: standard deviation of the target, to express ``mae`` in original units.
        target_channel: the channel of ``x`` holding the target's past, if any.
        season_length: the seasonal-naive forecast's and MASE's season, in timesteps.
    """
    x, y = _unpack(batch)
    # float() keeps the loss in fp32 when the forward pass ran under bf16/fp16 autocast.
    pred = module(x).float()
    loss = F.mse_loss(pred, y)
    window_mae = (pred.detach() - y).abs().mean(dim=1)
    metrics = {"mae": window_mae.mean() * target_std}
    if target_channel is not None:
        past = x[..., target_channel].float()
        metrics.update(skill_metrics(past, y, window_mae, season_length, target_std))
    return StepOutput(loss=loss, num_samples=int(y.shape[0]), metrics=metrics)


def skill_metrics(
    past: torch.Tensor,
    y: torch.Tensor,
    window_mae: torch.Tensor,
    season_length: int,
    target_std: float,
) -> dict[str, torch.Tensor]:
    """Per-sample means that tell whether a forecast beats naive ones on the same windows.

    ``mase``: each window's MAE over the in-sample MAE of the seasonal-naive forecast on its
    own context (below 1: better than that naive forecast did in sample), averaged over
    windows; ``persistence_mae``: MAE of repeating the context's last value;
    ``seasonal_naive_mae`` (``season_length`` > 1): of repeating its last season. Both MAEs
    in original units.

    Args:
        past: the target's standardised context, ``[B, T]``.
        y: the standardised targets, ``[B, horizon]``.
        window_mae: the model's MAE per window, standardised, ``[B]``.
    """
    m = season_length
    in_sample = (past[:, m:] - past[:, :-m]).abs().mean(dim=1).clamp_min(MIN_MASE_SCALE)
    metrics = {
        "mase": (window_mae / in_sample).mean(),
        "persistence_mae": (past[:, -1:] - y).abs().mean() * target_std,
    }
    if m > 1:
        horizon = torch.arange(y.shape[1], device=past.device)
        last_season = past[:, past.shape[1] - m + horizon % m]
        metrics["seasonal_naive_mae"] = (last_season - y).abs().mean() * target_std
    return metrics


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
    if params.get("scaling", "window") not in SCALING_OPTIONS:
        raise BadInputError(
            f"model.params.scaling must be one of {', '.join(SCALING_OPTIONS)}, "
            f"got {params['scaling']!r}."
        )


def _scaling_arguments(params: Mapping[str, Any], data_info: Mapping[str, Any]) -> dict:
    """``scaling`` and ``target_channel`` for the model, from the params and the data.

    Window scaling needs to know where the target's past is in ``x``: the built-in Parquet
    windows say so (``target_channel``). Data that does not (a user's data factory, or a
    checkpoint written before per-window scaling) gets global scaling, unless the config
    asks for window scaling explicitly, which is then an error.
    """
    if "target_channel" in data_info:
        return {"target_channel": int(data_info["target_channel"])}
    if params.get("scaling") == "window":
        raise BadInputError(
            "model.params.scaling: window needs data that names the target's input channel "
            "(data_info['target_channel'], as the built-in Parquet windows do); set "
            "model.params.scaling to global, or add target_channel to your data's info."
        )
    return {"scaling": "global"}


def build(params: Mapping[str, Any], data_info: Mapping[str, Any]) -> ModelSpec:
    """Protocol model factory: ``params`` are ``MODEL_PARAMS``; sizes and stats come from data_info.

    Args:
        params: optional constructor overrides, a subset of ``MODEL_PARAMS``.
        data_info: ``DataSplits.info`` from the window builder (``num_features``,
            ``context_length``, ``horizon``, ``target_mean``, ``target_std``, and optionally
            ``target_channel`` and ``season_length``).
    """
    _check_params(params)
    module = WindTransformer(
        num_features=int(data_info["num_features"]),
        context_length=int(data_info["context_length"]),
        horizon=int(data_info["horizon"]),
        **{**params, **_scaling_arguments(params, data_info)},
    )
    target_mean = float(data_info.get("target_mean", 0.0))
    target_std = float(data_info.get("target_std", 1.0))
    skill = {}
    if "target_channel" in data_info:
        skill = {
            "target_channel": int(data_info["target_channel"]),
            "season_length": int(data_info.get("season_length", 1)),
        }
    # partial of module-level functions, not closures, so the spec stays picklable.
    return ModelSpec(
        module=module,
        step=functools.partial(step, target_std=target_std, **skill),
        predict=functools.partial(predict, target_mean=target_mean, target_std=target_std),
    )
