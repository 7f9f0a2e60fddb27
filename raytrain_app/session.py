"""What the worker loop needs from whoever runs it: rank, device, wrapping, reporting.

The loop talks only to a ``WorkerSession``. ``RayTrainSession`` is the Ray Train worker
(DDP through ``prepare_model``, reports through ``ray.train.report``); the Tune layer
supplies a single-worker session of its own, so one loop serves both.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader


class WorkerSession(Protocol):
    """The runtime seen from inside one training worker."""

    world_rank: int
    world_size: int

    def device(self) -> torch.device: ...

    def prepare_model(self, module: nn.Module, strategy: str, ddp_kwargs: dict) -> nn.Module: ...

    def prepare_loader(self, loader: DataLoader) -> DataLoader: ...

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None: ...

    def restored_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]: ...

    def node_address(self) -> str: ...


class RayTrainSession:
    """A Ray Train V2 worker; the process group already exists (Ray created it)."""

    def __init__(self) -> None:
        import ray.train

        context = ray.train.get_context()
        self.world_rank = context.get_world_rank()
        self.world_size = context.get_world_size()

    def device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()

    def prepare_model(self, module: nn.Module, strategy: str, ddp_kwargs: dict) -> nn.Module:
        import ray.train.torch

        parallel = None if strategy == "single" else strategy
        return ray.train.torch.prepare_model(
            module, parallel_strategy=parallel, parallel_strategy_kwargs=ddp_kwargs
        )

    def prepare_loader(self, loader: DataLoader) -> DataLoader:
        import ray.train.torch

        # The loop builds its own samplers (sharded, same order for any world size), so
        # Ray only adds the transfer to the device.
        return ray.train.torch.prepare_data_loader(loader, add_dist_sampler=False)

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=checkpoint)

    @contextlib.contextmanager
    def restored_checkpoint(self) -> Iterator[Path | None]:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as directory:
            yield Path(directory)

    def node_address(self) -> str:
        import ray.util

        return ray.util.get_node_ip_address()


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A temporary directory for a checkpoint before the session persists it."""
    with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as directory:
        yield Path(directory)
