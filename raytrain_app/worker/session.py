"""What the worker loop needs from whoever runs it: rank, device, wrapping, reporting.

The loop talks only to a ``WorkerSession``. ``RayTrainSession`` is the Ray Train worker
(DDP through ``prepare_model``, reports through ``ray.train.report``); ``TuneTrialSession``
a single-worker Tune trial; ``InProcessSession`` a process without Ray (alone or on a
torchrun process group), used by the unit tests and benchmarks. One loop serves all.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import shutil
import socket
import tempfile
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from raytrain_app.checkpoint.store import MANIFEST_FILE, checkpoints_newest_first, name_progress
from raytrain_app.checkpoint.upload import upload_atomically, upload_shards_atomically

logger = logging.getLogger(__name__)


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

    def prepare_loader(self, loader: DataLoader) -> Any:
        # The loop builds its own samplers (sharded, same order for any world size), so all
        # Ray's prepare_data_loader would add is the move to the device; its rules differ
        # from every other session's (a NamedTuple arrives as a plain tuple, any Mapping as
        # a dict, a dataclass stays on the host): raytrain moves the batches itself.
        return on_device(loader, self.device())

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
    """``batch`` with every tensor in it on ``device``: the one rule for every batch raytrain
    moves (the loaders of every session, the memory probe).

    Ray's loader rules, kept where they agree: tensors move; lists, tuples and any
    ``Mapping`` are walked; anything else is passed through as it is. Unlike Ray's, the
    containers keep their type, since a step may read ``batch.images`` or call a tokenizer
    output's methods: a NamedTuple is rebuilt field by field, a ``dict`` subclass or
    ``UserDict`` (a Hugging Face ``BatchEncoding``) is copied with its other state (the
    encodings), another Mapping is rebuilt from a dict where its type allows (else it
    becomes the dict, as Ray makes every Mapping), and a dataclass is replaced field by
    field.
    """
    # Asynchronous only to a GPU: a copy back to the host must be complete when read.
    non_blocking = device.type == "cuda"
    return _map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` rebuilt with ``fn`` applied to every tensor in it (``to_device``'s rules)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return _rebuilt_mapping(batch, {k: _map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(type(batch), "_fields"):  # a NamedTuple
        return type(batch)(*(_map_tensors(item, fn) for item in batch))
    if isinstance(batch, tuple | list):
        items = [_map_tensors(item, fn) for item in batch]
        return items if type(batch) is list else type(batch)(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: _map_tensors(getattr(batch, f.name), fn)
            for f in dataclasses.fields(batch)
            if f.init  # the others are derived by the dataclass itself (__post_init__)
        }
        return dataclasses.replace(batch, **changes)
    return batch


def _rebuilt_mapping(batch: Mapping, moved: dict) -> Mapping:
    """``moved`` as the Mapping type of ``batch``."""
    if type(batch) is dict:
        return moved
    if isinstance(batch, dict | UserDict):
        # A copy keeps the type and what else it holds (a defaultdict's factory, a
        # BatchEncoding's encodings); replacing its values leaves ``batch`` as it was.
        rebuilt = copy.copy(batch)
        rebuilt.update(moved)
        return rebuilt
    try:
        rebuilt = type(batch)(moved)
    except (TypeError, ValueError):
        rebuilt = None
    # A constructor may take the dict and mean something else by it: keep only a faithful
    # copy, holding the very values moved.
    faithful = isinstance(rebuilt, Mapping) and rebuilt.keys() == moved.keys()
    if faithful and all(rebuilt[key] is value for key, value in moved.items()):
        return rebuilt
    logger.debug("%s cannot be rebuilt from a dict; the batch is a dict", type(batch))
    return moved


def on_device(loader: DataLoader, device: torch.device) -> Any:
    """``loader`` whose batches arrive on ``device`` (``loader`` itself for the CPU)."""
    return loader if device.type == "cpu" else _DeviceLoader(loader, device)


class _DeviceLoader:
    """Iterates a DataLoader with every batch moved to ``device`` by ``to_device``.

    On a GPU the next batch is copied on a side stream while the current one trains, as
    Ray's own loader does (``prepare_data_loader``'s ``auto_transfer``): the training
    stream waits for a batch's copy only when it takes that batch.
    """

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            return (to_device(batch, self.device) for batch in self.loader)
        return self._prefetched()

    def _prefetched(self) -> Iterator[Any]:
        copies = torch.cuda.Stream(self.device)
        batches = iter(self.loader)
        pending = self._staged(next(batches, _END), copies)
        while pending is not _END:
            torch.cuda.current_stream(self.device).wait_stream(copies)
            ready, pending = pending, self._staged(next(batches, _END), copies)
            yield ready

    def _staged(self, batch: Any, copies: torch.cuda.Stream) -> Any:
        """``batch`` copied to the device on the ``copies`` stream, its memory kept from
        reuse until the training stream is done with it (``record_stream``)."""
        if batch is _END:
            return _END
        training = torch.cuda.current_stream(self.device)

        def copy_for_training(tensor: torch.Tensor) -> torch.Tensor:
            moved = tensor.to(self.device, non_blocking=True)
            if moved.device.type == "cuda":
                moved.record_stream(training)
            return moved

        with torch.cuda.stream(copies):
            return _map_tensors(batch, copy_for_training)

    def __len__(self) -> int:
        return len(self.loader)


_END = object()  # the end of a loader's batches (a batch may be anything, None included)


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
        return on_device(loader, self._device)

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
