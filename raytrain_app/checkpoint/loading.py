"""Loading a trained model back: a checkpoint or a run directory to a plain ``nn.Module``.

Used by the public API (``load_model``) and ``raytrain predict``; needs nothing but the
checkpoint's directory, whose ``meta.json`` names the model factory by import path.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    load_tensors,
    read_meta,
    verify_checkpoint,
)
from raytrain_app.checkpoint.trust import CodeTrust, checked_factory, inference_meta
from raytrain_app.config import RaytrainConfig
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import ModelSpec
from raytrain_app.storage import StorageLocation, is_uri
from raytrain_app.workloads import build_model

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


@dataclass
class LoadedModel:
    """A checkpoint's model rebuilt, with what ``predict`` needs of the checkpoint."""

    spec: ModelSpec  # weights loaded, CPU, eval mode
    meta: dict[str, Any]  # meta.json, its factories and data info validated as data
    data_factory: Any  # meta.json's data factory entry, to pass to ``checked_factory``
    meta_file: str  # where meta.json was read, for messages
    run_root: Path | None  # the run directory holding it, whose code is never imported


def load_model_spec(
    path: str | Path, weights: str = "auto", trust: CodeTrust | None = None
) -> LoadedModel:
    """The trained model (weights loaded, CPU, eval mode) and its checkpoint's metadata.

    ``weights``: ``ema`` (the moving average), ``raw`` (the optimizer's weights) or ``auto``
    (the EMA when the run kept one: the weights its validation metrics were measured on).
    ``trust``: which factories named by ``meta.json`` may be called (``trust.py``); by
    default only raytrain's built-ins.
    """
    trust = trust or CodeTrust()
    with local_checkpoint(path) as (chosen, directory):
        weights_file = _weights_file(directory, weights, chosen)
        meta_file = f"{str(chosen).rstrip('/')}/{META_FILE}"
        meta = read_meta(directory)
        checked = inference_meta(meta, meta_file)
        run_root = _run_root(directory)
        model_ref = checked_factory(checked.model_factory, trust, meta_file, run_root)
        state = load_tensors(directory / weights_file)
    spec = build_model(model_ref, checked.data_info)
    problem = _state_dict_mismatch(spec.module.state_dict(), state)
    if problem:
        raise BadInputError(
            f"checkpoint '{chosen}': {weights_file} does not fit the model its {META_FILE} "
            f"describes ({problem}); pass a checkpoint directory written by raytrain for "
            f"this model"
        )
    spec.module.load_state_dict(state)
    spec.module.eval()
    return LoadedModel(spec, meta, checked.data_factory, meta_file, run_root)


def _run_root(checkpoint: Path) -> Path:
    """The run directory a local checkpoint lies in (``<run>/checkpoints/...``), else the
    checkpoint's own directory: no module is ever imported from under it."""
    for ancestor in checkpoint.resolve().parents:
        if ancestor.name == "checkpoints":
            return ancestor.parent
    return checkpoint.resolve()


def load_model(
    path: str | Path,
    weights: str = "auto",
    *,
    trust_code: bool = False,
    config: RaytrainConfig | dict | str | Path | None = None,
) -> nn.Module:
    """Rebuild the trained model as a plain ``nn.Module`` on CPU in eval mode.

    A checkpoint is data: the model factory its ``meta.json`` names is called only if it is
    built into raytrain, is the one ``config`` names, or ``trust_code=True``.

    Args:
        path: a checkpoint directory, or a run directory (its best checkpoint by
            train.monitor is used); a local path or a URI (``s3://bucket/runs/name``).
        weights: ``"ema"``, ``"raw"``, or ``"auto"``: the EMA of the weights when the run
            kept one (``train.ema.enabled``), else the raw weights.
        trust_code: call the factory the checkpoint names even if it is your own code
            (``model.target``): only for run directories whose writers you trust.
        config: your own config (e.g. the one you trained with; an object, a dict or a
            YAML path): the factories it names are trusted.
    """
    trust = CodeTrust.from_config(config, trust_code)
    return load_model_spec(path, weights, trust).spec.module
