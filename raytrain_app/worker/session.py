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
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from raytrain_app.checkpoint.store import MANIFEST_FILE, checkpoints_newest_first, name_progress
from raytrain_app.checkpoint.upload import (
    save_atomically,
    scratch_dir,
    upload_shards_atomically,
    write_in_place,
)
from raytrain_app.worker.device_batches import on_device, to_device

# to_device is imported from here by the memory probe and Ray Data's batches.
__all__ = ["to_device"]


class WorkerSession(Protocol):
    """The runtime seen from inside one training worker."""

    world_rank: int
    world_size: int
    # Whether checkpoints may be reported between epochs (train.checkpoint_every_steps).
    mid_epoch_checkpoints: bool
    # Whether checkpoints may be saved in the background (train.async_checkpoints), the
    # report going on before the save has ended.
    background_saves: bool

    def device(self) -> torch.device: ...

    def prepare_model(self, module: nn.Module, strategy: str, ddp_kwargs: dict) -> nn.Module: ...

    def prepare_loader(self, loader: DataLoader) -> DataLoader: ...

    def report(self, metrics: dict[str, Any], saved: Future | None, name: str | None) -> None:
        """Report ``metrics`` and, once ``saved`` (the future of this rank's save, whose
        result is what ``persist`` returned), its checkpoint (its part, for FSDP's
        shards). Every rank reports at the same points (Ray requires equal counts), with
        the checkpoint's ``name`` whether or not it writes a part of it."""
        ...

    def persist(self, write: Callable[[Path], Any], name: str, group: Any) -> Any:
        """Put the checkpoint that ``write(directory)`` writes into the run's storage as
        ``name`` (run by the checkpoint writer, in its thread when saves are in the
        background). ``group``: the process group of a checkpoint every rank writes a part
        of (FSDP), None for one this rank writes alone."""
        ...

    def restored_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]: ...

    def node_address(self) -> str: ...


class RayTrainSession:
    """A Ray Train V2 worker; the process group already exists (Ray created it)."""

    mid_epoch_checkpoints = True
    background_saves = True

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

    def report(self, metrics: dict[str, Any], saved: Future | None, name: str | None) -> None:
        import ray.train

        checkpoint: dict[str, Any] = {}
        if saved is not None:
            # Ray registers the checkpoint once the writer has persisted it: its upload
            # function only waits for that, in Ray's upload thread. Ray passes it the
            # checkpoint reported, here the run's checkpoint folder, which it ignores.
            storage = ray.train.get_context().get_storage()
            folder = storage.experiment_fs_path
            checkpoint = {
                "checkpoint": ray.train.Checkpoint(folder, filesystem=storage.storage_filesystem),
                "delete_local_checkpoint_after_upload": False,
                "checkpoint_upload_fn": lambda _reported, _name: saved.result(),
            }
        # Asynchronous without a checkpoint too: a synchronous report waits until the one
        # before it is registered, that is for the save in flight.
        ray.train.report(
            metrics,
            checkpoint_dir_name=name,
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            **checkpoint,
        )

    def persist(self, write: Callable[[Path], Any], name: str, group: Any) -> Any:
        return persist_shards(write, name, group) if group else save_atomically(write, name)

    def restored_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        import ray.train

        return checkpoint_directory(newest_persisted(ray.train.get_checkpoint()))

    def node_address(self) -> str:
        return _node_address()


def persist_shards(write: Callable[[Path], Any], name: str, group: Any, storage: Any = None) -> Any:
    """This rank's part of a sharded checkpoint, written into a scratch directory and
    merged with the other ranks' into the run's storage (``upload_shards_atomically``)."""
    import ray.train

    with scratch_dir() as directory:
        write(directory)
        local = ray.train.Checkpoint.from_directory(directory)
        return upload_shards_atomically(local, name, storage=storage, group=group)


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


class InProcessSession:
    """This process as a worker, without Ray: alone, or one rank of a process group that
    someone else made (torchrun, or a test's gloo processes).

    Checkpoints are copied into ``storage`` under their names, a name already taken
    getting a ``-rN`` suffix as in Ray Train, and ``restored_checkpoint`` hands back the
    newest: what Ray Train does across a restart. Without ``storage`` they are dropped.
    Every report is kept in ``reports``.
    """

    # Whether checkpoints may be reported between epochs (train.checkpoint_every_steps).
    mid_epoch_checkpoints = True
    background_saves = True

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

    def report(self, metrics: dict[str, Any], saved: Future | None, name: str | None) -> None:
        self.reports.append({**metrics, "checkpoint": name if saved else None})

    def persist(self, write: Callable[[Path], Any], name: str, group: Any) -> Path | None:
        if self.storage is None:
            return None
        target, attempt = self.storage / name, 1
        while target.exists():  # the same step written again after a fallback, as in Ray
            target, attempt = self.storage / f"{name}-r{attempt}", attempt + 1
        if group is None or self.world_size == 1:
            return write_in_place(write, target)
        # Every rank adds its files to rank 0's directory, as Ray merges them.
        chosen = [target]
        dist.broadcast_object_list(chosen, src=0, group=group)
        dist.barrier(group=group)
        with scratch_dir() as directory:
            write(directory)
            shutil.copytree(directory, chosen[0], dirs_exist_ok=True)
        dist.barrier(group=group)
        return chosen[0]

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
    # tune.report copies the checkpoint's files as it reports: they must be written.
    background_saves = False

    def __init__(self, use_gpu: bool) -> None:
        super().__init__(device="cuda:0" if use_gpu else "cpu")
        self.world_rank, self.world_size = 0, 1

    def report(self, metrics: dict[str, Any], saved: Future | None, name: str | None) -> None:
        from ray import tune

        if saved is None:
            tune.report(metrics)
            return
        written = saved.result()  # already: a trial's saves are not in the background
        try:
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(written))
        finally:
            shutil.rmtree(written, ignore_errors=True)

    def persist(self, write: Callable[[Path], Any], name: str, group: Any) -> Path:
        """Write the checkpoint for ``report``, which hands it to Tune (Tune copies it)."""
        written = Path(tempfile.mkdtemp(prefix="raytrain-ckpt-"))
        write(written)
        return written

    def restored_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        from ray import tune

        return checkpoint_directory(tune.get_checkpoint())

    def node_address(self) -> str:
        return _node_address()
