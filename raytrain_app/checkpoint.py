"""Checkpoint layout, saving and loading.

A checkpoint directory holds:

- ``model.pt``: the plain model ``state_dict`` (no ``module.`` / ``_orig_mod.`` prefixes),
  loadable into the bare ``nn.Module`` on any device;
- ``train_state.pt``: optimizer, scheduler, GradScaler, epoch, step and every rank's RNG
  states, everything an exact resume needs;
- ``meta.json``: the model factory and params, the data info the model was sized from,
  and the resolved run config, so ``load_model`` needs nothing but the directory.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain_app.errors import BadInputError
from raytrain_app.protocol import ModelSpec

MODEL_FILE = "model.pt"
TRAIN_STATE_FILE = "train_state.pt"
META_FILE = "meta.json"


def unwrap_model(module: nn.Module) -> nn.Module:
    """The bare model under DDP/FSDP (``.module``) and torch.compile (``._orig_mod``)."""
    while True:
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


def rng_state() -> dict[str, Any]:
    """This process's random generator states (torch, CUDA, numpy, python)."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by ``rng_state``."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(
    directory: Path,
    *,
    model: nn.Module,
    train_state: dict[str, Any],
    meta: dict[str, Any],
) -> Path:
    """Write a checkpoint into ``directory`` (created if needed) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save(unwrap_model(model).state_dict(), directory / MODEL_FILE)
    _atomic_torch_save(train_state, directory / TRAIN_STATE_FILE)
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return directory


def load_train_state(directory: Path) -> dict[str, Any]:
    """The optimizer/scheduler/RNG state of a checkpoint, on CPU."""
    # weights_only=False: the state holds numpy RNG tuples, and the file is our own.
    return torch.load(directory / TRAIN_STATE_FILE, map_location="cpu", weights_only=False)


def read_meta(directory: Path) -> dict[str, Any]:
    """The checkpoint's metadata (model factory, data info, resolved config)."""
    return json.loads((directory / META_FILE).read_text())


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a checkpoint directory, or a run directory to its newest checkpoint."""
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return path
    summary = path / "summary.json"
    try:
        newest = json.loads(summary.read_text()).get("checkpoint") if summary.is_file() else None
    except json.JSONDecodeError:
        newest = None  # a damaged summary: fall back to the newest checkpoint on disk
    if newest and (Path(newest) / MODEL_FILE).is_file():
        return Path(newest)
    candidates = sorted(
        (p.parent for p in path.glob("checkpoints/**/" + MODEL_FILE)),
        key=lambda p: p.stat().st_mtime,
    )
    if candidates:
        return candidates[-1]
    raise BadInputError(
        f"--checkpoint '{path}' is neither a checkpoint directory (with {MODEL_FILE}) nor a "
        f"run directory with checkpoints; pass the path printed at the end of 'raytrain train'"
    )


def load_model_spec(path: str | Path) -> tuple[ModelSpec, dict[str, Any]]:
    """The trained model's ``ModelSpec`` (weights loaded, CPU, eval mode) and its metadata."""
    from raytrain_app.workloads import FactoryRef, build_model

    directory = find_checkpoint(path)
    meta = read_meta(directory)
    spec = build_model(FactoryRef(**meta["model_factory"]), meta["data_info"])
    state = torch.load(directory / MODEL_FILE, map_location="cpu", weights_only=True)
    spec.module.load_state_dict(state)
    spec.module.eval()
    return spec, meta


def load_model(path: str | Path) -> nn.Module:
    """Rebuild the trained model as a plain ``nn.Module`` on CPU in eval mode.

    Args:
        path: a checkpoint directory, or a run directory (its newest checkpoint is used).
    """
    return load_model_spec(path)[0].module
