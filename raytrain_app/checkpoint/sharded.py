"""Checkpoints of a sharded (FSDP) model: every rank writes its part, as FSDP requires.

The resumable state (model, optimizer and EMA shards) is a ``torch.distributed.checkpoint``
(DCP): ``.metadata`` from rank 0 and one ``__<rank>_0.distcp`` file per rank, each written
into that rank's own scratch directory and merged into one checkpoint directory when the
ranks report it (``upload.py``). DCP reshards on load, so a run resumes at any world size.
Beside it, rank 0 writes the usual plain files (``store.py``): ``model.pt`` and ``ema.pt``
as full state dicts gathered from every rank onto rank 0's CPU, so ``load_model`` and
``raytrain predict`` still get a plain module, ``train_state.pt`` without the optimizer,
``meta.json``, and ``manifest.json`` covering every rank's files.
"""

from __future__ import annotations

import collections
import copyreg
import io
import pathlib
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.checkpoint import store
from raytrain_app.errors import BadInputError

# FSDP and torch.distributed.checkpoint are imported where they are used: importing them
# (with DTensor) takes some 0.7 s of CPU, which every worker and driver process would pay
# at start, and only an FSDP run uses them.

# Written by rank 0 (DCP's coordinator) last among the DCP files.
SHARDED_METADATA_FILE = ".metadata"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or what torch.compile wraps) is sharded with FSDP2."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:  # never imported in this process: nothing here was sharded
        return False
    return any(isinstance(m, fsdp.FSDPModule) for m in store.unwrap_model(model).modules())


def has_sharded_state(directory: Path) -> bool:
    """Whether a checkpoint holds its resumable state as DCP shards."""
    return (directory / SHARDED_METADATA_FILE).is_file()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def full_state_dict(module: nn.Module) -> dict[str, Any]:
    """The full state dict on rank 0's CPU (empty elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(store.unwrap_model(module), options=options)


def _resumable(model: nn.Module, optimizer: Any, ema: nn.Module | None) -> dict[str, Any]:
    """This rank's shards of the model, optimizer and EMA, keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_state, optimizer_state = get_state_dict(store.unwrap_model(model), optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema)
    return state


def save_sharded(
    directory: Path,
    *,
    model: nn.Module,
    optimizer: Any,
    ema: nn.Module | None,
    train_state: dict[str, Any],
    meta: dict[str, Any],
) -> None:
    """Write this rank's part of a checkpoint into ``directory``; every rank calls it."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(_resumable(model, optimizer, ema), checkpoint_id=str(directory))
    model_state = full_state_dict(model)
    ema_state = full_state_dict(ema) if ema is not None else None
    # Rank 0's manifest lists every rank's shard: a checkpoint missing one is torn.
    others = _all_gather(store.file_digests(directory) if _rank() != 0 else {})
    if _rank() != 0:
        return
    shards = {name: digest for files in others for name, digest in files.items()}
    store.save_checkpoint(
        directory,
        model=model_state,
        train_state=train_state,
        meta=meta,
        ema=ema_state,
        other_files=shards,
    )


def load_sharded(
    directory: Path, *, model: nn.Module, optimizer: Any, ema: nn.Module | None
) -> None:
    """Load a sharded checkpoint into ``model``, ``optimizer`` and ``ema`` (sharded or not,
    at any world size); every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _resumable(model, optimizer, ema)
    saved_ema = ema is not None and _has_key(directory, "ema")
    if ema is not None and not saved_ema:
        del state["ema"]
    with warnings.catch_warnings():
        # One process without a process group (a one-worker resume) reads every shard
        # itself, as intended: DCP warns that it assumes so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=_reader(directory), no_dist=not dist.is_initialized())
    set_state_dict(
        store.unwrap_model(model),
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    if saved_ema:
        set_model_state_dict(ema, state["ema"])


def _has_key(directory: Path, prefix: str) -> bool:
    metadata = _reader(directory).read_metadata()
    return any(key.startswith(prefix + ".") for key in metadata.state_dict_metadata)


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _reader(directory: Path) -> Any:
    """DCP's file reader with its ``.metadata`` read as data.

    DCP unpickles ``.metadata`` with plain ``pickle.load``: a replaced file in a shared run
    directory would run code in every rank that resumes. The metadata is a tree of DCP's
    own dataclasses, torch sizes and dtypes; anything else is refused.
    """
    import torch.distributed.checkpoint as dcp

    class MetadataReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self.path) / SHARDED_METADATA_FILE
            metadata = load_dcp_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp.metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return MetadataReader(str(directory))


def load_dcp_metadata(path: Path) -> Any:
    """A DCP ``.metadata`` file, unpickled with only the classes it may hold.

    Raises:
        BadInputError: the file names anything else (it was replaced or edited).
    """
    try:
        return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise BadInputError(
            f"'{path}' is not a sharded checkpoint's metadata ({exc}), so it was not loaded "
            f"(unpickling it could run code); use a checkpoint written by raytrain, or start "
            f"a new run (experiment.name)"
        ) from None


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What DCP's metadata pickles reference: its dataclasses and enums, torch's sizes,
    dtypes, layouts and memory formats, and the standard reconstructors."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    classes = [
        metadata.ChunkStorageMetadata,
        metadata._MEM_FORMAT_ENCODING,
        metadata.TensorProperties,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.StorageMeta,
        metadata.Metadata,
        metadata.MetadataIndex,
        filesystem._StorageInfo,
        planner.LoadItemType,
        planner.WriteItemType,
        torch.Size,
        collections.OrderedDict,
        pathlib.PosixPath,  # StorageMeta.checkpoint_id: the directory DCP wrote to
        object,
    ]
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    allowed[("copyreg", "_reconstructor")] = copyreg._reconstructor
    # A layout pickles as a call of this lookup by name (torch.serialization).
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in dir(torch):  # dtypes (torch.float32), layouts, memory formats
        value = getattr(torch, name)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``_allowed_globals`` (Python's documented
    way of restricting what a pickle may call)."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        try:
            return _MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}") from None
