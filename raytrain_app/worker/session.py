"""What the worker loop needs from whoever runs it: rank, device, wrapping, reporting.

The loop talks only to a ``WorkerSession``. ``RayTrainSession`` is the Ray Train worker
(DDP through ``prepare_model``, reports through ``ray.train.report``); ``TuneTrialSession``
a single-worker Tune trial; ``InProcessSession`` a process without Ray (alone or on a
torchrun process group), used by the unit tests and benchmarks. One loop serves all.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from raytrain_app.checkpoint.store import MANIFEST_FILE, checkpoints_newest_first, name_progress
from raytrain_app.checkpoint.upload import upload_atomically, upload_shards_atomically


class WorkerSession(Protocol):
    """The runtime seen from inside one training worker."""

    world_rank: int
    world_size: int
    # Whether checkpoints may be reported between epochs (train.checkpoint_every_steps).
    mid_epoch_checkpoints: bool

    def device(self) -> torch.device: ...

    def prepare_model(self, module: nn.Module, strategy: str, ddp_kwargs: dict) -> nn.Module: ...

    def prepare_loader(self, loader: DataLoader) -> DataLoader: ...

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint_dir: Path | None,
        name: str | None,
        every_rank: bool = False,
    ) -> None:
        """``every_rank``: each rank passes its part of one checkpoint (FSDP's shards)."""
        ...

    def restored_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]: ...

    def node_address(self) -> str: ...


class RayTrainSession:
    """A Ray Train V2 worker; the process group already exists (Ray created it)."""

    mid_epoch_checkpoints = True

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

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint_dir: Path | None,
        name: str | None,
        every_rank: bool = False,
    ) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=name,
            checkpoint_upload_fn=upload_shards_atomically if every_rank else upload_atomically,
        )

    def restored_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        import ray.train

        return checkpoint_directory(newest_persisted(ray.train.get_checkpoint()))

    def node_address(self) -> str:
        return _node_address()


def newest_persisted(reported: Any, storage: Any = None) -> Any:
    """Ray's latest checkpoint, or a newer complete one in the run's storage.

    Ray records a checkpoint in its run state only after the upload: a driver killed in
    between leaves the newest checkpoint on storage but unknown to Ray's next run (and a
    run in Ray Train's local mode, ``worker.local_mode``, records none). Every rank lists
    the same storage, so all resume from the same one. ``storage``: Ray Train's
    ``StorageContext`` by default.
    """
    import pyarrow.fs
    import ray.train

    storage = storage or ray.train.get_context().get_storage()
    fs = storage.storage_filesystem
    try:
        entries = fs.get_file_info(pyarrow.fs.FileSelector(storage.experiment_fs_path))
    except (FileNotFoundError, OSError):
        return reported
    named = [(name_progress(e.base_name), e.path) for e in entries if e.type.name == "Directory"]
    complete = [
        (progress, path)
        for progress, path in named
        if progress is not None
        and fs.get_file_info(f"{path}/{MANIFEST_FILE}").type == pyarrow.fs.FileType.File
    ]
    if not complete:
        return reported
    progress, path = max(complete)
    if reported is not None:
        known = name_progress(Path(reported.path).name)
        if known is not None and known >= progress:
            return reported
    return ray.train.Checkpoint(path, filesystem=fs)


@contextlib.contextmanager
def checkpoint_directory(checkpoint: Any) -> Iterator[Path | None]:
    """A Ray checkpoint (Train's or Tune's) as a local directory, or None."""
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as directory:
        yield Path(directory)


def _node_address() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A temporary directory for a checkpoint before the session persists it."""
    with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as directory:
        yield Path(directory)


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


class _DeviceLoader:
    """Iterates a DataLoader with every batch moved to ``device``."""

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[Any]:
        return (to_device(batch, self.device) for batch in self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class InProcessSession:
    """This process as a worker, without Ray: alone, or one rank of a process group that
    someone else made (torchrun, or a test's gloo processes).

    Reported checkpoints are copied into ``storage`` under their names, a name already
    taken getting a ``-rN`` suffix as in Ray Train, and ``restored_checkpoint`` hands back
    the newest: what Ray Train does across a restart. Without ``storage`` they are
    dropped. Every report is kept in ``reports``.
    """

    # Whether checkpoints may be reported between epochs (train.checkpoint_every_steps).
    mid_epoch_checkpoints = True

    def __init__(self, storage: Path | None = None, device: str = "cpu") -> None:
        grouped = dist.is_available() and dist.is_initialized()
        self.world_rank = dist.get_rank() if grouped else 0
        self.world_size = dist.get_world_size() if grouped else 1
        self.storage = storage
        self._device = torch.device(device)
        self.reports: list[dict[str, Any]] = []

    def device(self) -> torch.device:
        return self._device

    def prepare_model(self, module: nn.Module, strategy: str, ddp_kwargs: dict) -> nn.Module:
        module = module.to(self._device)
        if strategy == "single" or self.world_size == 1:
            return module
        return nn.parallel.DistributedDataParallel(module, **ddp_kwargs)

    def prepare_loader(self, loader: DataLoader) -> Any:
        return loader if self._device.type == "cpu" else _DeviceLoader(loader, self._device)

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint_dir: Path | None,
        name: str | None,
        every_rank: bool = False,
    ) -> None:
        self.reports.append({**metrics, "checkpoint": name if checkpoint_dir else None})
        if checkpoint_dir is None or self.storage is None:
            return
        target, attempt = self.storage / name, 1
        while target.exists():  # the same step written again after a fallback, as in Ray
            target, attempt = self.storage / f"{name}-r{attempt}", attempt + 1
        if not (every_rank and self.world_size > 1):
            shutil.copytree(checkpoint_dir, target)
            return
        # Every rank adds its files to rank 0's directory, as Ray merges them.
        chosen = [target]
        dist.broadcast_object_list(chosen, src=0)
        dist.barrier()
        shutil.copytree(checkpoint_dir, chosen[0], dirs_exist_ok=True)
        dist.barrier()

    def checkpoints(self) -> list[Path]:
        """The persisted checkpoints, newest first."""
        return checkpoints_newest_first(self.storage) if self.storage else []

    @contextlib.contextmanager
    def restored_checkpoint(self) -> Iterator[Path | None]:
        found = self.checkpoints()
        yield found[0] if found else None

    def node_address(self) -> str:
        return socket.gethostname()


class TuneTrialSession(InProcessSession):
    """A single-worker Ray Tune trial: no process group, no DDP, one device; reports and
    checkpoints go to Tune.

    Tune reserves the trial's GPU and sets ``CUDA_VISIBLE_DEVICES``, so it is ``cuda:0``.
    """

    # A Tune result is a scheduler decision point (ASHA rungs, PBT): epochs only.
    mid_epoch_checkpoints = False

    def __init__(self, use_gpu: bool) -> None:
        super().__init__(device="cuda:0" if use_gpu else "cpu")
        self.world_rank, self.world_size = 0, 1

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint_dir: Path | None,
        name: str | None,
        every_rank: bool = False,
    ) -> None:
        from ray import tune

        checkpoint = tune.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        tune.report(metrics, checkpoint=checkpoint)

    def restored_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        from ray import tune

        return checkpoint_directory(tune.get_checkpoint())

    def node_address(self) -> str:
        return _node_address()
