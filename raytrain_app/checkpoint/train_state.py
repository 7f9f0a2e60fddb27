"""What a checkpoint holds to continue a run exactly, written and read in one place.

Besides the weights (and the EMA weights): the optimizer, scheduler and GradScaler states,
the loop's counters, and for every rank its RNG states and the sums of an unfinished
epoch. ``store.py`` owns the files; this module owns what goes into them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from raytrain_app.checkpoint import sharded
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.lr_rescale import rescale_lrs
from raytrain_app.checkpoint.snapshot import Snapshot
from raytrain_app.errors import BadInputError

logger = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """This process's random generator states (torch, numpy, python, and the CUDA state of
    this worker's own device: a resume may see another number of GPUs).

    Tensors and plain values only, so that a checkpoint loads with ``weights_only=True``:
    numpy's state tuple holds an array, which torch's safe loader refuses.
    """
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by ``rng_state``."""
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["kind"],
            saved["keys"].numpy().astype(np.uint32),
            saved["position"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    random.setstate(_python_state(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        device = torch.cuda.current_device()
        restore_cuda_rng(state["cuda"], device, lambda s: torch.cuda.set_rng_state(s, device))


def _python_state(saved: Any) -> tuple:
    """``random.getstate()``'s tuple (version, 625 ints, gauss) as saved; lists after a
    round trip through a format without tuples."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def restore_cuda_rng(
    saved: torch.Tensor | list[torch.Tensor], device: int, set_state: Callable[[torch.Tensor], Any]
) -> None:
    """Restore this worker's CUDA generator (``device``, its index) with ``set_state``.

    ``saved`` is the state of the device the worker had (or, in checkpoints of earlier
    versions, a list with every GPU that worker saw, its own at its device index). A
    resume on another layout (a requeue onto another node, fewer GPUs) finds no entry for
    a device index the list lacks: that worker's CUDA stream restarts from the seed.
    """
    if isinstance(saved, torch.Tensor):
        set_state(saved)
    elif device < len(saved):
        set_state(saved[device])
    else:
        logger.info("no saved CUDA random state for device %d: its stream restarts", device)


@dataclass
class LoopState:
    """The loop's counters."""

    epoch: int = 0  # completed epochs
    step: int = 0  # optimizer steps taken, skipped non-finite ones included
    history: list[dict[str, float]] = field(default_factory=list)
    step_in_epoch: int = 0  # steps of the unfinished epoch ``epoch`` already taken
    skipped_steps: int = 0  # steps skipped for a non-finite loss (train.on_nonfinite=skip)
    # [first optimizer step, world size] of each stretch trained at one size (elastic runs
    # resize; a resume may use another size).
    segments: list[list[int]] = field(default_factory=list)

    def note_world_size(self, world_size: int) -> None:
        """Start a segment at the current step if the size changed (or on the first start)."""
        if not self.segments or self.segments[-1][1] != world_size:
            self.segments = [*self.segments, [self.step, world_size]]


@dataclass
class Trainables:
    """The objects a checkpoint saves and a resume loads back into."""

    model: nn.Module  # as trained (DDP, compiled); saved without the wrappers' prefixes
    module: nn.Module  # the bare module underneath, loaded into on resume
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ema: AveragedModel | None
    # The plan's peak lr (train.lr after lr_scaling), saved so that a resume at another
    # lr rescales the schedule from it; None where the model's configure_optimizers sets
    # the lrs.
    lr: float | None = None


def save_resumable(
    directory: Path,
    trainables: Trainables,
    state: LoopState,
    ranks: list[dict[str, Any]],
    meta: dict[str, Any],
) -> None:
    """Write a checkpoint of ``trainables`` and ``state`` now (``snapshot_resumable``,
    written at once, without copying)."""
    snapshot_resumable(trainables, state, ranks, meta).write(directory)


def snapshot_resumable(
    trainables: Trainables,
    state: LoopState,
    ranks: list[dict[str, Any]],
    meta: dict[str, Any],
    copy: Callable[[Any], Any] = lambda state: state,
) -> Snapshot:
    """What a checkpoint of ``trainables`` and ``state`` holds, passed through ``copy``
    (``snapshot.HostCopies`` where training goes on before it is written; as it is where
    it is written at once). ``ranks`` holds every rank's ``{"rng": ..., "epoch": ...}``
    (gathered by the caller). A sharded (FSDP) model's checkpoint is written by every
    rank, each its part (``sharded.py``), and every rank must call this; any other by
    rank 0 alone."""
    t = trainables
    ema = t.ema.module if t.ema is not None else None
    if sharded.is_sharded(t.model):
        shards, model_state, ema_state = sharded.sharded_state(t.model, t.optimizer, ema)
        # The full state dicts are new copies already, gathered onto rank 0's CPU.
        rest = copy({"meta": meta, "train_state": _loop_state(t, state, ranks)})
        return Snapshot(model=model_state, ema=ema_state, shards=copy(shards), **rest)
    tensors = copied_tensors(t)
    plain = {
        "model": tensors["model"],
        "ema": tensors["ema"],
        "train_state": {"optimizer": tensors["optimizer"], **_loop_state(t, state, ranks)},
        "meta": meta,
    }
    return Snapshot(**copy(plain))


def copied_tensors(trainables: Trainables) -> dict[str, Any]:
    """The large tensors a plain (not sharded) checkpoint copies into host memory: the
    weights, the EMA's and the optimizer's state, by reference. What every checkpoint
    copies, and what ``snapshot.HostCopies.prepare`` allocates buffers for ahead."""
    t = trainables
    ema = t.ema.module if t.ema is not None else None
    return {
        "model": ckpt.unwrap_model(t.model).state_dict(),
        "ema": ckpt.unwrap_model(ema).state_dict() if ema is not None else None,
        "optimizer": t.optimizer.state_dict(),
    }


def _loop_state(t: Trainables, state: LoopState, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What train_state.pt holds besides the optimizer."""
    return {
        "scheduler": t.scheduler.state_dict(),
        "scaler": t.scaler.state_dict(),
        "epoch": state.epoch,
        "step": state.step,
        "step_in_epoch": state.step_in_epoch,
        "skipped_steps": state.skipped_steps,
        "history": state.history,
        "segments": state.segments,
        "ranks": ranks,
        "ema_n_averaged": int(t.ema.n_averaged) if t.ema is not None else 0,
        "lr": t.lr,
    }


@dataclass
class Resumed:
    """A checkpoint loaded back: where from, the counters, and every rank's saved part."""

    directory: Path
    state: LoopState
    ranks: list[dict[str, Any]]

    def restore_rank(self, rank: int, world_size: int) -> dict[str, Any]:
        """Restore this rank's RNG states and return its unfinished epoch's sums.

        A checkpoint written by another world size restarts the random streams from the
        seed; a global step covers the same samples for any world size, so the epoch's
        sums stay exact when rank 0 carries all of them.
        """
        if len(self.ranks) == world_size:
            set_rng_state(self.ranks[rank]["rng"])
            return self.ranks[rank]["epoch"]
        if rank == 0:
            logger.info(
                "checkpoint was written by %d workers, this run has %d: "
                "random streams restart from the seed",
                len(self.ranks),
                world_size,
            )
        return merged_epoch_progress([r["epoch"] for r in self.ranks], rank)


def load_resumable(
    directory: Path, trainables: Trainables, lr: float | None, device: torch.device
) -> Resumed:
    """Load ``directory`` into ``trainables`` (or, if it is torn or corrupted, the newest
    intact checkpoint older than it). The schedule goes on at peak lr ``lr``: every lr it
    holds is rescaled from the one the checkpoint was written at (``lr_rescale.py``);
    None keeps the saved ones."""
    directory = ckpt.usable_checkpoint(directory)
    saved = ckpt.load_train_state(directory)
    t = trainables
    if sharded.has_sharded_state(directory):  # written by FSDP: DCP reshards it
        ema = t.ema.module if t.ema is not None else None
        sharded.load_sharded(directory, model=t.model, optimizer=t.optimizer, ema=ema)
    else:
        _load_plain(directory, t, saved, device)
    if t.ema is not None and (directory / ckpt.EMA_FILE).is_file():
        t.ema.n_averaged.fill_(saved["ema_n_averaged"])
    t.scheduler.load_state_dict(saved["scheduler"])
    # The current plan's lr wins over the saved one: equal on a plain resume, different
    # when a Tune PBT trial continues a better trial's checkpoint with a mutated lr.
    if lr is not None:
        saved_lr = saved.get("lr") or _earlier_lr(t.optimizer)
        rescale_lrs(t.scheduler, t.optimizer, lr / saved_lr)
    _load_scaler(t.scaler, saved["scaler"])
    state = LoopState(
        epoch=saved["epoch"],
        step=saved["step"],
        history=saved["history"],
        step_in_epoch=saved["step_in_epoch"],
        skipped_steps=saved["skipped_steps"],
        segments=saved.get("segments", []),  # absent in checkpoints of earlier versions
    )
    return Resumed(directory, state, saved["ranks"])


def _earlier_lr(optimizer: torch.optim.Optimizer) -> float:
    """The lr a checkpoint that recorded none (of an earlier version, or of a model's own
    configure_optimizers) was trained at: its first group's start, over its lr_multiplier
    (absent in earlier checkpoints: 1), where every built-in schedule starts."""
    group = optimizer.param_groups[0]
    return group["initial_lr"] / group.get("lr_multiplier", 1.0)


def _load_scaler(scaler: torch.amp.GradScaler, saved: dict[str, Any]) -> None:
    """The saved GradScaler state into ``scaler``, across a change of precision.

    A Tune PBT trial may continue another trial's checkpoint with ``precision`` mutated:
    a disabled scaler (fp32, bf16) saves ``{}``, which torch refuses to load into an
    enabled one (fp16), and a disabled scaler ignores whatever it is given (torch's
    ``load_state_dict`` returns at once).
    """
    if scaler.is_enabled() and not saved:
        logger.info(
            "checkpoint was written without fp16 loss scaling; the GradScaler starts from "
            "its initial scale"
        )
        return
    scaler.load_state_dict(saved)


def _load_plain(
    directory: Path, t: Trainables, saved: dict[str, Any], device: torch.device
) -> None:
    """A checkpoint written by rank 0 alone (DDP, one worker) into ``t``."""
    if sharded.is_sharded(t.model):
        raise BadInputError(
            f"checkpoint '{directory}' was not written with distributed.strategy=fsdp, so "
            f"its optimizer state cannot be sharded; resume with the strategy it was "
            f"written with, or start a new run (experiment.name)"
        )
    t.module.load_state_dict(ckpt.load_tensors(directory / ckpt.MODEL_FILE, device))
    ema_file = directory / ckpt.EMA_FILE
    if t.ema is not None and ema_file.is_file():
        t.ema.module.load_state_dict(ckpt.load_tensors(ema_file, device))
    t.optimizer.load_state_dict(saved["optimizer"])


def merged_epoch_progress(saved: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """Mid-epoch sums written by another world size: rank 0 takes their total."""
    if rank != 0:
        return {"elapsed_s": max(p["elapsed_s"] for p in saved)}
    sums: dict[str, float] = {}
    counts: dict[str, torch.Tensor] = {}  # StepOutput.counts, absent in older checkpoints
    for progress in saved:
        for key, value in progress["sums"].items():
            sums[key] = sums.get(key, 0.0) + value
        for key, value in progress.get("counts", {}).items():
            counts[key] = counts[key] + value if key in counts else value.clone()
    return {
        "sums": sums,
        **({"counts": counts} if counts else {}),
        "elapsed_s": max(p["elapsed_s"] for p in saved),
        "skipped_steps": saved[0]["skipped_steps"],
    }
