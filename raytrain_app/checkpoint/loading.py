"""Loading a trained model back: a checkpoint or a run directory to a plain ``nn.Module``.

Used by the public API (``load_model``) and ``raytrain predict``; needs nothing but the
checkpoint's directory, whose ``meta.json`` names the model factory by import path.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raytrain_app.checkpoint.ranking import best_of_run, metas_newest_first
from raytrain_app.checkpoint.store import (
    EMA_FILE,
    INFERENCE_FILES,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    DamagedCheckpointError,
    checkpoints_newest_first,
    read_meta,
    verify_checkpoint,
)
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import ModelSpec
from raytrain_app.storage import StorageLocation, is_uri
from raytrain_app.workloads import FactoryRef, build_model

logger = logging.getLogger(__name__)


def find_checkpoint(path: str | Path) -> Path | str:
    """Resolve a checkpoint directory (verified), or a run directory to its best intact one.

    A run directory's best checkpoint is the one with the best ``train.monitor`` (the
    model to use for inference; a resume always continues from the newest instead); when
    no checkpoint has the metric, or the best one is damaged, the newest intact one.
    ``path`` may be a URI (``s3://...``): the chosen checkpoint's URI is returned.

    Raises:
        DamagedCheckpointError: the named checkpoint directory is damaged.
        BadInputError: ``path`` holds no checkpoint.
    """
    if is_uri(path):
        with local_checkpoint(path) as (chosen, _):
            return chosen
    path = Path(path)
    if (path / MODEL_FILE).is_file() or (path / MANIFEST_FILE).is_file():
        verify_checkpoint(path, INFERENCE_FILES)
        return path
    candidates = checkpoints_newest_first(path / "checkpoints")
    best = best_of_run(path / "checkpoints")
    ordered = [best.path] if best else []
    for candidate in ordered + [c for c in candidates if c not in ordered]:
        try:
            verify_checkpoint(candidate, INFERENCE_FILES)
            return candidate
        except DamagedCheckpointError:
            logger.warning("skipping the damaged checkpoint %s", candidate)
    if candidates:
        verify_checkpoint(candidates[0], INFERENCE_FILES)  # all damaged: report the newest
    raise BadInputError(
        f"--checkpoint '{path}' is neither a checkpoint directory (with {MODEL_FILE}) nor a "
        f"run directory with checkpoints; pass the path printed at the end of 'raytrain train'"
    )


@contextlib.contextmanager
def local_checkpoint(path: str | Path) -> Iterator[tuple[Path | str, Path]]:
    """The checkpoint ``find_checkpoint`` chooses, as ``(its path or URI, a local verified
    directory)``.

    A checkpoint in an object store is chosen from its run's listing and ``meta.json``
    files; only the chosen one is downloaded, into a temporary directory removed on exit.
    """
    if not is_uri(path):
        directory = find_checkpoint(path)
        yield directory, Path(directory)
        return
    location = StorageLocation.parse(path, "--checkpoint")
    with tempfile.TemporaryDirectory(prefix="raytrain-load-") as scratch:
        yield _download_verified(location, Path(scratch))


def _download_verified(location: StorageLocation, scratch: Path) -> tuple[str, Path]:
    """``find_checkpoint`` for a location in an object store, downloading into ``scratch``."""
    if location.child(MODEL_FILE).is_file() or location.child(MANIFEST_FILE).is_file():
        local = location.download(scratch / location.name)
        verify_checkpoint(local, INFERENCE_FILES)
        return location.uri, local
    folder = location.child("checkpoints")
    candidates = [str(uri) for uri, _ in metas_newest_first(folder)]
    best = best_of_run(folder)
    ordered = [str(best.path)] if best else []
    for candidate in ordered + [c for c in candidates if c not in ordered]:
        directory = _download(folder, candidate, scratch)
        try:
            verify_checkpoint(directory, INFERENCE_FILES)
            return candidate, directory
        except DamagedCheckpointError:
            logger.warning("skipping the damaged checkpoint %s", candidate)
    if candidates:  # all damaged: report the newest
        verify_checkpoint(_download(folder, candidates[0], scratch), INFERENCE_FILES)
    raise BadInputError(
        f"--checkpoint '{location}' is neither a checkpoint directory (with {MODEL_FILE}) nor "
        f"a run directory with checkpoints; pass the path printed at the end of 'raytrain train'"
    )


def _download(folder: StorageLocation, uri: str, scratch: Path) -> Path:
    """Download the checkpoint at ``uri`` (under ``folder``) into its own folder in ``scratch``."""
    checkpoint = folder.child(uri[len(folder.uri) :].strip("/"))
    return checkpoint.download(scratch / checkpoint.name)


def _state_dict_mismatch(expected: dict[str, Any], found: dict[str, Any]) -> str:
    """A short account of how two state dicts differ; empty when they fit."""
    kinds = {
        "missing": sorted(expected.keys() - found.keys()),
        "unexpected": sorted(found.keys() - expected.keys()),
        "of another shape": sorted(
            k for k in expected.keys() & found.keys() if expected[k].shape != found[k].shape
        ),
    }
    return "; ".join(
        f"{len(keys)} {kind} key(s), e.g. '{keys[0]}'" for kind, keys in kinds.items() if keys
    )


def _weights_file(directory: Path, weights: str, shown: Path | str) -> str:
    if weights not in ("auto", "ema", "raw"):
        raise BadInputError(f"weights='{weights}' is not one of auto, ema, raw")
    has_ema = (directory / EMA_FILE).is_file()
    if weights == "ema" and not has_ema:
        raise BadInputError(
            f"checkpoint '{shown}' has no EMA weights ({EMA_FILE}); train with "
            f"train.ema.enabled=true, or load weights='raw'"
        )
    return EMA_FILE if has_ema and weights != "raw" else MODEL_FILE


def load_model_spec(path: str | Path, weights: str = "auto") -> tuple[ModelSpec, dict[str, Any]]:
    """The trained model's ``ModelSpec`` (weights loaded, CPU, eval mode) and its metadata.

    ``weights``: ``ema`` (the moving average), ``raw`` (the optimizer's weights) or ``auto``
    (the EMA when the run kept one: the weights its validation metrics were measured on).
    """
    with local_checkpoint(path) as (chosen, directory):
        weights_file = _weights_file(directory, weights, chosen)
        meta = read_meta(directory)
        spec = build_model(FactoryRef(**meta["model_factory"]), meta["data_info"])
        state = torch.load(directory / weights_file, map_location="cpu", weights_only=True)
    problem = _state_dict_mismatch(spec.module.state_dict(), state)
    if problem:
        raise BadInputError(
            f"checkpoint '{chosen}': {weights_file} does not fit the model its {META_FILE} "
            f"describes ({problem}); pass a checkpoint directory written by raytrain for "
            f"this model"
        )
    spec.module.load_state_dict(state)
    spec.module.eval()
    return spec, meta


def load_model(path: str | Path, weights: str = "auto") -> nn.Module:
    """Rebuild the trained model as a plain ``nn.Module`` on CPU in eval mode.

    Args:
        path: a checkpoint directory, or a run directory (its best checkpoint by
            train.monitor is used); a local path or a URI (``s3://bucket/runs/name``).
        weights: ``"ema"``, ``"raw"``, or ``"auto"``: the EMA of the weights when the run
            kept one (``train.ema.enabled``), else the raw weights.
    """
    return load_model_spec(path, weights)[0].module
