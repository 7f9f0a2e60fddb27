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

import sys
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from raytrain_app.checkpoint import store

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


def sharded_state(
    model: nn.Module, optimizer: Any, ema: nn.Module | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """This rank's shards of the model, optimizer and EMA (as they are: copy them to keep
    them), and the full model and EMA state dicts, new copies on rank 0's CPU (empty
    elsewhere). Every rank must call it: the full state dicts are gathered."""
    shards = _resumable(model, optimizer, ema)
    return shards, full_state_dict(model), full_state_dict(ema) if ema is not None else None


def write_sharded(
    directory: Path,
    *,
    shards: dict[str, Any],
    model_state: dict[str, Any],
    ema_state: dict[str, Any] | None,
    train_state: dict[str, Any],
    meta: dict[str, Any],
    group: Any = None,
) -> None:
    """Write this rank's part of a checkpoint into ``directory``; every rank calls it,
    its collectives over ``group`` (None: the default group)."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(shards, checkpoint_id=str(directory), process_group=group)
    # Rank 0's manifest lists every rank's shard: a checkpoint missing one is torn.
    others = _all_gather(store.file_digests(directory) if _rank() != 0 else {}, group)
    if _rank() != 0:
        return
    digests = {name: digest for files in others for name, digest in files.items()}
    store.save_checkpoint(
        directory,
        model=model_state,
        train_state=train_state,
        meta=meta,
        ema=ema_state,
        other_files=digests,
    )


def load_sharded(
    directory: Path, *, model: nn.Module, optimizer: Any, ema: nn.Module | None
) -> None:
    """Load a sharded checkpoint into ``model``, ``optimizer`` and ``ema`` (sharded or not,
    at any world size); every rank calls it.

    Everything DCP would unpickle is read as data (``dcp_data.py``).

    Raises:
        BadInputError: a file holds anything else (it was replaced or edited).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from raytrain_app.checkpoint import dcp_data

    # Read before DCP does: inside dcp.load a refusal would be retried, then wrapped.
    checked = dcp_data.load_dcp_metadata(directory / SHARDED_METADATA_FILE)
    state = _resumable(model, optimizer, ema)
    saved_ema = ema is not None and any(k.startswith("ema.") for k in checked.state_dict_metadata)
    if ema is not None and not saved_ema:
        del state["ema"]
    reader = dcp_data.CheckedReader(directory, checked)
    with warnings.catch_warnings():
        # One process without a process group (a one-worker resume) reads every shard
        # itself, as intended: DCP warns that it assumes so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(
                state,
                storage_reader=reader,
                planner=dcp_data.DataLoadPlanner(directory),
                no_dist=not dist.is_initialized(),
            )
        except dcp.api.CheckpointException as exc:
            refused = dcp_data.refusal(exc)
            if refused is None:
                raise
            raise refused from None
    set_state_dict(
        store.unwrap_model(model),
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    if saved_ema:
        set_model_state_dict(ema, state["ema"])


def _all_gather(obj: Any, group: Any = None) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out
