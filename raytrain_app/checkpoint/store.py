"""A checkpoint's files: layout, writing with a manifest, verifying, and finding them.

A checkpoint directory holds:

- ``model.pt``: the plain model ``state_dict`` (no ``module.`` / ``_orig_mod.`` prefixes),
  loadable into the bare ``nn.Module`` on any device;
- ``train_state.pt``: optimizer, scheduler, GradScaler, epoch, step and every rank's RNG
  states, everything an exact resume needs;
- ``ema.pt`` (only with ``train.ema.enabled``): the exponential moving average of the
  weights, a ``state_dict`` of the same plain model;
- ``meta.json``: the model factory and params, the data info the model was sized from,
  and the resolved run config, so ``load_model`` needs nothing but the directory; and
  the files of ``data.path`` it was trained on, which a resume checks
  (``data_identity.py``);
- ``manifest.json``, written last: every other file's size and SHA-256. A checkpoint
  whose manifest is missing or disagrees with the files was torn or corrupted, and is
  never loaded: resumes fall back to the next older valid checkpoint;
- with ``distributed.strategy: fsdp`` also the sharded resumable state, one file per rank
  (``sharded.py``); ``train_state.pt`` then holds no optimizer state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raytrain_app.checkpoint.direct_file import DigestingFile
from raytrain_app.errors import BadInputError, first_line

logger = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
TRAIN_STATE_FILE = "train_state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
EMA_FILE = "ema.pt"


def checkpoint_name(epoch: int, step: int) -> str:
    """Directory name of the checkpoint after ``step`` optimizer steps (``epoch`` completed).

    Names sort by training progress, and a step has one name however often it is retried.
    """
    return f"checkpoint_epoch{epoch:04d}_step{step:09d}"


_NAME_PROGRESS = re.compile(r"checkpoint_epoch(\d+)_step(\d+)(-r\d+)?$")


def name_progress(name: str) -> tuple[int, int, int] | None:
    """(epoch, step, rewrite) of a checkpoint directory's name, None for another name;
    greater means newer."""
    match = _NAME_PROGRESS.search(name)
    if not match:
        return None
    return int(match[1]), int(match[2]), int(match[3][2:]) if match[3] else 0


class DamagedCheckpointError(BadInputError):
    """A checkpoint's files disagree with its manifest (a torn write or a corrupted file)."""


def unwrap_model(module: nn.Module) -> nn.Module:
    """The bare model under DDP/FSDP (``.module``) and torch.compile (``._orig_mod``)."""
    while True:
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


def _atomic_torch_save(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save ``obj`` to ``path`` (whole or not at all); the file's size and SHA-256,
    as the manifest lists them, taken from the bytes as they were written.

    torch.save writes into a file object (``DigestingFile``), not to a path: given a path
    it writes each tensor with the GIL held (0.1-0.35 s for a 200-400 MB tensor, during
    which the training thread beside a background save cannot run); given a file object it
    hands each record over as a memoryview, which the file copies, digests and writes with
    the GIL let go (``benchmarks/README.md``, "Checkpoints off the step's path").
    """
    tmp = path.with_name(path.name + ".tmp")
    with DigestingFile(tmp) as out, _without_crc32():
        torch.save(obj, out)
    os.replace(tmp, path)
    return {"size": out.size, "sha256": out.sha256.hexdigest()}


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save without the CRC-32 of every record in its zip: what a load checks is
    manifest.json's SHA-256 of each file, and the CRC is a third of torch.save's CPU time
    (0.25 s of 0.71 s for 1.2 GB of tensors written to tmpfs on a 2-core machine), the GIL
    held all along, on the step's path or beside it. torch.load reads either. torch < 2.6
    always computes it."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        yield
        return
    with config.patch("save.compute_crc32", False):
        yield


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digests(directory: Path, known: frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """Every file's size and SHA-256, by name, as ``manifest.json`` lists them; the files
    named in ``known`` left out."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE and p.name not in known
    }


def write_manifest(directory: Path, other_files: dict[str, Any] | None = None) -> None:
    """Record every file's size and checksum; written last, so its presence means complete.

    ``other_files``: digests of files digested already, as they were written (by this
    rank's torch.save, or by other ranks into the same checkpoint); every other file in
    ``directory`` is read and digested here.
    """
    known = other_files or {}
    files = {**known, **file_digests(directory, frozenset(known))}
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps({"format": 1, "files": files}, indent=2))
    os.replace(tmp, directory / MANIFEST_FILE)


# What resuming needs, and the subset that loading the model for inference needs (a model
# shipped without its optimizer state is still verified).
RESUME_FILES = (MODEL_FILE, TRAIN_STATE_FILE, META_FILE)
INFERENCE_FILES = (MODEL_FILE, META_FILE)


def verify_checkpoint(directory: Path, needed: tuple[str, ...] = RESUME_FILES) -> None:
    """Raise ``DamagedCheckpointError`` unless ``needed`` and every other file present
    match ``manifest.json``."""

    def damaged(problem: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(
            f"checkpoint '{directory}' is damaged: {problem}; use an older checkpoint of the "
            f"run (its checkpoints/ folder) or train again"
        )

    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise damaged(f"{MANIFEST_FILE} is missing (the write was interrupted)") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise damaged(f"{MANIFEST_FILE} is unreadable") from None
    for name in needed:
        if name not in files:
            raise damaged(f"{MANIFEST_FILE} does not list {name}")
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            if name not in needed:
                continue
            raise damaged(f"{name} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            raise damaged(f"{name} has {size} bytes, the manifest says {expected['size']}")
        if _sha256(path) != expected["sha256"]:
            raise damaged(f"{name} does not match its checksum")


def is_valid_checkpoint(directory: Path) -> bool:
    try:
        verify_checkpoint(directory)
    except DamagedCheckpointError:
        return False
    return True


def save_checkpoint(
    directory: Path,
    *,
    model: nn.Module | dict[str, Any],
    train_state: dict[str, Any],
    meta: dict[str, Any],
    ema: nn.Module | dict[str, Any] | None = None,
    other_files: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint into ``directory`` (created if needed), manifest last.

    ``model`` and ``ema``: modules, or their plain state dicts (a sharded model's, gathered);
    ``other_files``: digests of the files other ranks add to the checkpoint.
    """
    directory.mkdir(parents=True, exist_ok=True)
    written = {MODEL_FILE: _atomic_torch_save(_plain_state(model), directory / MODEL_FILE)}
    if ema is not None:
        written[EMA_FILE] = _atomic_torch_save(_plain_state(ema), directory / EMA_FILE)
    written[TRAIN_STATE_FILE] = _atomic_torch_save(train_state, directory / TRAIN_STATE_FILE)
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    write_manifest(directory, {**(other_files or {}), **written})
    return directory


def _plain_state(model: nn.Module | dict[str, Any]) -> dict[str, Any]:
    return model if isinstance(model, dict) else unwrap_model(model).state_dict()


def _progress_key(directory: Path) -> tuple[int, int, float]:
    """Sort key: (epoch, step) from the name, else from meta.json, then modification time
    (0 for a directory deleted meanwhile, by a run's retention)."""
    try:
        modified = directory.stat().st_mtime
    except OSError:
        modified = 0.0
    match = _NAME_PROGRESS.search(directory.name)
    if match:
        return int(match[1]), int(match[2]), modified
    try:
        meta = read_meta(directory)
        return int(meta["epoch"]), int(meta["step"]), modified
    except (OSError, ValueError, KeyError, TypeError):
        return -1, -1, modified


def checkpoints_newest_first(folder: Path) -> list[Path]:
    """Every checkpoint directory under ``folder`` (any depth), newest progress first.

    A run may be writing beside the listing (``predict`` on a run that trains, a test
    watching one): a checkpoint being written (``<name>.partial``, renamed once complete)
    is neither listed nor entered, and a directory that vanishes while it is listed (that
    rename, or the retention deleting a checkpoint) is passed over.
    """
    found = []
    for root, directories, files in os.walk(folder, followlinks=True):  # errors: passed over
        directories[:] = [name for name in directories if ".partial" not in name]
        if MODEL_FILE in files and ".partial" not in Path(root).name:
            found.append(Path(root))
    return sorted(found, key=_progress_key, reverse=True)


def usable_checkpoint(directory: Path) -> Path:
    """``directory`` if it is intact, else the newest intact checkpoint older than it.

    Raises:
        DamagedCheckpointError: ``directory`` is damaged and no older intact one exists.
    """
    try:
        verify_checkpoint(directory)
        return directory
    except DamagedCheckpointError as exc:
        damaged = exc
    logger.warning("%s", damaged)
    limit = _progress_key(directory)[:2]
    for older in checkpoints_newest_first(directory.parent):
        if older != directory and _progress_key(older)[:2] <= limit and is_valid_checkpoint(older):
            logger.warning("resuming from the older checkpoint %s instead", older)
            return older
    raise DamagedCheckpointError(
        f"{damaged.args[0].split('; ')[0]}, and no older intact checkpoint is left in "
        f"'{directory.parent}'; delete the run directory to start over"
    )


def load_train_state(directory: Path) -> dict[str, Any]:
    """The optimizer/scheduler/RNG state of a checkpoint, on CPU.

    Loaded as data only (``weights_only=True``): a run directory is shared, and a replaced
    ``train_state.pt`` must not run code in every worker that resumes from it.

    Raises:
        BadInputError: the file holds anything but tensors and plain values.
    """
    return load_tensors(directory / TRAIN_STATE_FILE)


def load_tensors(path: Path, map_location: Any = "cpu") -> Any:
    """``torch.load`` of a checkpoint file as data: tensors and plain values, nothing else.

    Raises:
        BadInputError: the file holds other objects (a pickle that could run code, or a
            checkpoint of a raytrain version that stored numpy objects).
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise BadInputError(
            f"'{path}' holds objects other than tensors and plain values ({_refused(exc)}), "
            f"so it was not loaded: unpickling it could run code; use a checkpoint written "
            f"by this version of raytrain, or start a new run (experiment.name)"
        ) from None


def _refused(exc: Exception) -> str:
    """What torch's safe loader refused ("unsupported GLOBAL posix.system"), from its long
    message, whose first lines only say that weights_only is on."""
    match = re.search(r"(unsupported GLOBAL \S+|Unsupported global: GLOBAL \S+)", str(exc))
    return match[1] if match else "not tensors or plain values"


def read_meta(directory: Path) -> dict[str, Any]:
    """The checkpoint's metadata (model factory, data info, resolved config).

    Raises:
        BadInputError: ``meta.json`` is not one JSON object (one line naming the file).
    """
    path = directory / META_FILE
    try:
        meta = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, _DuplicateKeyError) as exc:
        raise BadInputError(
            f"'{path}' is not valid JSON ({first_line(exc)}); it was edited or damaged: use "
            f"a checkpoint written by raytrain"
        ) from None
    if not isinstance(meta, dict):
        raise BadInputError(
            f"'{path}' holds a JSON {type(meta).__name__}, not an object; it was edited or "
            f"damaged: use a checkpoint written by raytrain"
        )
    return meta


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: two values for one key is an edit, not ours."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(f"the key '{key}' appears twice")
        result[key] = value
    return result
