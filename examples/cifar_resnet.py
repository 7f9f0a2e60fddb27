"""A user's CIFAR/ResNet recipe on raytrain: the model is the user's, the optimisation is
config (``examples/cifar_resnet.yaml``): SGD with Nesterov momentum 0.9, weight decay 5e-4
on the convolution weights only, a multistep schedule.

The network is a CIFAR-style ResNet (built from raytrain's ``ResNetSmall`` blocks, as a
user package would import a backbone); it trains on the built-in synthetic 32x32 images.
Run from the repository root:
    PYTHONPATH=examples raytrain train --config examples/cifar_resnet.yaml
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raytrain_app import ModelSpec
from raytrain_app.models.resnet_small import ResNetSmall, predict, step

__all__ = ["build_model"]


def build_model(params: Mapping[str, Any], data_info: Mapping[str, Any]) -> ModelSpec:
    """A ResNet for ``data_info``'s classes; ``params``: widths, blocks_per_stage."""
    module = ResNetSmall(
        num_classes=int(data_info["num_classes"]),
        in_channels=int(data_info.get("in_channels", 3)),
        widths=tuple(params.get("widths", (16, 32, 64))),
        blocks_per_stage=int(params.get("blocks_per_stage", 1)),
    )
    return ModelSpec(module=module, step=step, predict=predict)
