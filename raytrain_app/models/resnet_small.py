"""The built-in image classifier: a small ResNet with BatchNorm, for CIFAR-sized images."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from raytrain_app.errors import BadInputError
from raytrain_app.protocol import ModelSpec, StepOutput

# Constructor arguments a config may set as model.params; the rest come from data_info.
MODEL_PARAMS = ("widths", "blocks_per_stage")


class BasicBlock(nn.Module):
    """Two 3x3 conv + BatchNorm layers with an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetSmall(nn.Module):
    """Maps ``[batch, in_channels, H, W]`` images to ``[batch, num_classes]`` logits.

    A 3x3 stem, then one stage per entry of ``widths`` (the first at full resolution, each
    later one halving it), global average pooling and a linear classifier.
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        blocks, channels = [], widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)
        self.gradient_checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        """Trade compute for memory (raytrain's optimizations.gradient_checkpointing hook)."""
        self.gradient_checkpointing = True
        # Made here, outside any compiled region: dynamo runs a disabled function eagerly
        # (``_checkpointed``), and importing it for the wrapper costs seconds only now.
        self._eager_checkpoint = torch.compiler.disable(_frozen_checkpoint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stem(x)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                features = self._checkpointed(block, features)
            else:
                features = block(features)
        return self.head(features.mean(dim=(2, 3)))

    def _checkpointed(self, block: nn.Module, features: torch.Tensor) -> torch.Tensor:
        """``block(features)`` with its activations recomputed in backward instead of kept.

        Eagerly, the backward pass re-runs the block's forward, BatchNorm's running-statistics
        update included: the recomputation runs with the statistics frozen. Under
        torch.compile the checkpoint is a region of one functionalized graph, and the
        partitioner recomputes only what the gradients need: the statistics are updated once
        without help. torch also refuses the eager remedy there: dynamo rejects a closure as
        ``context_fn``, and AOT autograd any ``context_fn`` that is not a pair of
        selective-checkpoint dispatch modes. A synchronised BatchNorm runs outside compiled
        graphs (worker/sync_batchnorm.py), and the graph break would make dynamo run the
        checkpoint eagerly without the frozen recomputation: such a block runs eagerly here,
        with it.
        """
        if not torch.compiler.is_compiling():
            return _frozen_checkpoint(block, features)
        if _synchronised(block):
            return self._eager_checkpoint(block, features)
        return checkpoint(block, features, use_reentrant=False)


def _frozen_checkpoint(block: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """``checkpoint`` with BatchNorm's running statistics frozen while backward recomputes."""
    return checkpoint(
        block,
        features,
        use_reentrant=False,
        context_fn=functools.partial(_frozen_on_recompute, block),
    )


def _synchronised(block: nn.Module) -> bool:
    """Whether ``block`` holds a BatchNorm that synchronises across ranks (SyncBatchNorm and
    raytrain's gloo version carry a process group)."""
    return any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) and hasattr(m, "process_group")
        for m in block.modules()
    )


def _frozen_on_recompute(
    block: nn.Module,
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``checkpoint``'s (forward, recomputation) contexts for ``block``."""
    return contextlib.nullcontext(), _batchnorm_statistics_frozen(block)


@contextlib.contextmanager
def _batchnorm_statistics_frozen(module: nn.Module) -> Iterator[None]:
    """The backward pass re-runs a checkpointed block's forward; without this its BatchNorm
    layers would fold the same batch into their running statistics a second time."""
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in layers]
    for layer in layers:
        layer.momentum = 0.0  # running = (1 - 0) * running + 0 * batch
    try:
        yield
    finally:
        for layer, (momentum, tracked) in zip(layers, saved, strict=True):
            layer.momentum = momentum
            layer.num_batches_tracked.copy_(tracked)


def step(module: nn.Module, batch: Any) -> StepOutput:
    """Cross-entropy loss and ``accuracy``, both means over the batch's images."""
    images, labels = batch
    # float() keeps the loss in fp32 when the forward pass ran under bf16/fp16 autocast.
    logits = module(images).float()
    accuracy = (logits.detach().argmax(dim=1) == labels).float().mean()
    return StepOutput(
        loss=F.cross_entropy(logits, labels),
        num_samples=int(labels.shape[0]),
        metrics={"accuracy": accuracy},
    )


def predict(module: nn.Module, batch: Any) -> torch.Tensor:
    """The predicted class of every image in ``batch`` = ``images`` or ``(images, ...)``."""
    images = batch if isinstance(batch, torch.Tensor) else batch[0]
    return module(images).argmax(dim=1)


def _check_params(params: Mapping[str, Any]) -> None:
    """Reject unknown or invalid model.params with a message naming the key."""
    for key in params:
        if key not in MODEL_PARAMS:
            raise BadInputError(
                f"Unknown key model.params.{key} for resnet_small; "
                f"allowed keys: {', '.join(MODEL_PARAMS)}."
            )
    widths = params.get("widths")
    if "widths" in params and (
        not isinstance(widths, list | tuple)
        or not widths
        or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths)
    ):
        raise BadInputError(
            "model.params.widths must be a non-empty list of positive integers, e.g. [16, 32, 64]."
        )
    blocks = params.get("blocks_per_stage")
    if "blocks_per_stage" in params and (
        not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1
    ):
        raise BadInputError("model.params.blocks_per_stage must be an integer >= 1.")


def build(params: Mapping[str, Any], data_info: Mapping[str, Any]) -> ModelSpec:
    """Protocol model factory: ``params`` are ``MODEL_PARAMS``; sizes come from data_info.

    Args:
        params: optional constructor overrides, a subset of ``MODEL_PARAMS``.
        data_info: ``DataSplits.info`` of an image dataset (``num_classes``, ``in_channels``).
    """
    _check_params(params)
    module = ResNetSmall(
        num_classes=int(data_info["num_classes"]),
        in_channels=int(data_info.get("in_channels", 3)),
        **{k: tuple(v) if k == "widths" else v for k, v in params.items()},
    )
    return ModelSpec(module=module, step=step, predict=predict)
