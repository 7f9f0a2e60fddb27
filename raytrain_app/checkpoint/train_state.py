"""What a checkpoint holds to continue a run exactly, written and read in one place.

Besides the weights (and the EMA weights): the optimizer, scheduler and GradScaler states,
the loop's counters, and for every rank its RNG states and the sums of an unfinished
epoch. ``store.py`` owns the files; this module owns what goes into them.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from raytrain_app.checkpoint import store as ckpt

logger = logging.getLogger(__name__)


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


@dataclass
class LoopState:
    """The loop's counters."""

    epoch: int = 0  # completed epochs
    step: int = 0  # optimizer steps taken, skipped non-finite ones included
    history: list[dict[str, float]] = field(default_factory=list)
    step_in_epoch: int = 0  # steps of the unfinished epoch ``epoch`` already taken
    skipped_steps: int = 0  # steps skipped for a non-finite loss (train.on_nonfinite=skip)


@dataclass
class Trainables:
    """The objects a checkpoint saves and a resume loads back into."""

    model: nn.Module  # as trained (DDP, compiled); saved without the wrappers' prefixes
    module: nn.Module  # the bare module underneath, loaded into on resume
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ema: AveragedModel | None


def save_resumable(
    directory: Path,
    trainables: Trainables,
    state: LoopState,
    ranks: list[dict[str, Any]],
    meta: dict[str, Any],
) -> None:
    """Write a checkpoint of ``trainables`` and ``state``; ``ranks`` holds every rank's
    ``{"rng": ..., "epoch": ...}`` (gathered by the caller)."""
    t = trainables
    ckpt.save_checkpoint(
        directory,
        model=t.model,
        train_state={
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "scaler": t.scaler.state_dict(),
            "epoch": state.epoch,
            "step": state.step,
            "step_in_epoch": state.step_in_epoch,
            "skipped_steps": state.skipped_steps,
            "history": state.history,
            "ranks": ranks,
            "ema_n_averaged": int(t.ema.n_averaged) if t.ema is not None else 0,
        },
        meta=meta,
        ema=t.ema.module if t.ema is not None else None,
    )


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
    directory: Path, trainables: Trainables, lr: float, device: torch.device
) -> Resumed:
    """Load ``directory`` into ``trainables`` (or, if it is torn or corrupted, the newest
    intact checkpoint older than it). ``lr`` replaces the saved base learning rate."""
    directory = ckpt.usable_checkpoint(directory)
    saved = ckpt.load_train_state(directory)
    t = trainables
    t.module.load_state_dict(
        torch.load(directory / ckpt.MODEL_FILE, map_location=device, weights_only=True)
    )
    ema_file = directory / ckpt.EMA_FILE
    if t.ema is not None and ema_file.is_file():
        t.ema.module.load_state_dict(torch.load(ema_file, map_location=device, weights_only=True))
        t.ema.n_averaged.fill_(saved["ema_n_averaged"])
    t.optimizer.load_state_dict(saved["optimizer"])
    t.scheduler.load_state_dict(saved["scheduler"])
    # The current plan's lr wins over the saved one: equal on a plain resume, different
    # when a Tune PBT trial continues a better trial's checkpoint with a mutated lr.
    t.scheduler.base_lrs = [lr] * len(t.scheduler.base_lrs)
    t.scaler.load_state_dict(saved["scaler"])
    state = LoopState(
        epoch=saved["epoch"],
        step=saved["step"],
        history=saved["history"],
        step_in_epoch=saved["step_in_epoch"],
        skipped_steps=saved["skipped_steps"],
    )
    return Resumed(directory, state, saved["ranks"])


def merged_epoch_progress(saved: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """Mid-epoch sums written by another world size: rank 0 takes their total."""
    if rank != 0:
        return {"elapsed_s": max(p["elapsed_s"] for p in saved)}
    sums: dict[str, float] = {}
    for progress in saved:
        for key, value in progress["sums"].items():
            sums[key] = sums.get(key, 0.0) + value
    return {
        "sums": sums,
        "elapsed_s": max(p["elapsed_s"] for p in saved),
        "skipped_steps": saved[0]["skipped_steps"],
    }
