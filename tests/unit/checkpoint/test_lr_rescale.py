"""A Tune PBT trial continues another trial's checkpoint at its own (mutated) lr: from the
resumed step on, every kind of schedule gives the optimizer the lrs a fresh run at the new
lr gives at those steps (lrs that ``schedule.params`` sets itself, OneCycleLR's ``max_lr``
or ``eta_min``, moved by the same ratio), through a real checkpoint's save and load."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.train_state import (
    LoopState,
    Trainables,
    load_resumable,
    rng_state,
    save_resumable,
)
from raytrain_app.config import TrainConfig
from raytrain_app.worker.recipe import build_scheduler

CPU = torch.device("cpu")
OLD_LR, NEW_LR = 0.01, 0.03
SAVED_AT = 5  # optimizer steps before the checkpoint
AFTER = 12  # steps compared after it: past every milestone below

# name -> build(optimizer, scale): ``scale`` multiplies the lrs the schedule's own params
# set, as a run whose lr is ``scale`` times the saved one would have them.
Build = Callable[[torch.optim.Optimizer, float], sched.LRScheduler]
KINDS: dict[str, Build] = {
    "lambda": lambda o, s: sched.LambdaLR(o, lambda step: 1 / (1 + step)),
    "step": lambda o, s: sched.StepLR(o, step_size=3, gamma=0.5),
    "cosine_with_eta_min": lambda o, s: sched.CosineAnnealingLR(o, T_max=14, eta_min=1e-3 * s),
    "onecycle": lambda o, s: sched.OneCycleLR(o, max_lr=0.05 * s, total_steps=20),
    "cyclic": lambda o, s: sched.CyclicLR(
        o, base_lr=1e-3 * s, max_lr=1e-2 * s, step_size_up=3, cycle_momentum=False
    ),
    "sequential_of_three": lambda o, s: sched.SequentialLR(
        o,
        [
            sched.LinearLR(o, start_factor=0.1, total_iters=3),
            sched.ExponentialLR(o, gamma=0.9),
            sched.PolynomialLR(o, total_iters=10, power=2.0),
        ],
        milestones=[3, 8],  # the second change comes after the resume
    ),
    "chained": lambda o, s: sched.ChainedScheduler(
        [sched.ConstantLR(o, factor=0.5, total_iters=7), sched.ExponentialLR(o, gamma=0.9)]
    ),
    # raytrain's own warmup ramp around a train.schedule.target (a SequentialLR).
    "warmup_then_target": lambda o, s: build_scheduler(
        o,
        TrainConfig(
            warmup_steps=3,
            schedule={
                "target": "torch.optim.lr_scheduler:MultiStepLR",
                "params": {"milestones": [4, 9], "gamma": 0.5},
            },
        ),
        total_steps=20,
        steps_per_epoch=5,
    ),
}


def _trainables(build: Build, lr: float, scale: float) -> Trainables:
    """A model with two parameter groups (the second at lr_multiplier 0.1), as
    ``worker/recipe.py`` builds them, with momentum for CyclicLR and OneCycleLR."""
    torch.manual_seed(0)
    module = nn.Linear(3, 1)
    groups = [
        {"params": [module.weight], "lr": lr, "lr_multiplier": 1.0},
        {"params": [module.bias], "lr": lr * 0.1, "lr_multiplier": 0.1},
    ]
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.9)
    scheduler = build(optimizer, scale)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Trainables(module, module, optimizer, scheduler, scaler, None, lr)


def _lrs_of_steps(t: Trainables, steps: int) -> list[list[float]]:
    """The lr of each group at each of ``steps`` optimizer steps, stepping as the loop does."""
    used = []
    for _ in range(steps):
        used.append([float(group["lr"]) for group in t.optimizer.param_groups])
        t.module(torch.ones(2, 3)).sum().backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        t.scheduler.step()
    return used


def _checkpoint(tmp_path, saved: Trainables):
    """``saved`` trained ``SAVED_AT`` steps and checkpointed."""
    _lrs_of_steps(saved, SAVED_AT)
    state = LoopState(epoch=1, step=SAVED_AT)
    directory = tmp_path / ckpt.checkpoint_name(state.epoch, state.step)
    ranks = [{"rng": rng_state(), "epoch": {"sums": {}, "elapsed_s": 0.0, "skipped_steps": 0}}]
    save_resumable(directory, saved, state, ranks, meta={"epoch": 1, "step": SAVED_AT})
    return directory


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_schedule_goes_on_as_a_fresh_run_at_the_new_lr(tmp_path, kind):
    directory = _checkpoint(tmp_path, _trainables(KINDS[kind], OLD_LR, 1.0))

    # The PBT trial builds its optimizer and schedule at its own lr, then resumes.
    resumed = _trainables(KINDS[kind], NEW_LR, 1.0)
    load_resumable(directory, resumed, NEW_LR, CPU)
    fresh = _trainables(KINDS[kind], NEW_LR, NEW_LR / OLD_LR)
    expected = _lrs_of_steps(fresh, SAVED_AT + AFTER)[SAVED_AT:]

    found = _lrs_of_steps(resumed, AFTER)
    assert found == [pytest.approx(lrs, rel=1e-9) for lrs in expected]
    assert resumed.scheduler.get_last_lr() == pytest.approx(fresh.scheduler.get_last_lr())


@pytest.mark.parametrize("kind", ["lambda", "step"])
def test_a_checkpoint_that_recorded_no_lr_goes_on_at_the_new_one(tmp_path, kind):
    """Checkpoints of earlier versions recorded no lr: a built-in schedule's start is it."""
    saved = _trainables(KINDS[kind], OLD_LR, 1.0)
    saved.lr = None
    directory = _checkpoint(tmp_path, saved)
    resumed = _trainables(KINDS[kind], NEW_LR, 1.0)
    load_resumable(directory, resumed, NEW_LR, CPU)
    fresh = _trainables(KINDS[kind], NEW_LR, 1.0)
    expected = _lrs_of_steps(fresh, SAVED_AT + AFTER)[SAVED_AT:]
    assert _lrs_of_steps(resumed, AFTER) == [pytest.approx(lrs, rel=1e-9) for lrs in expected]


def test_a_plain_resume_keeps_the_saved_lrs_bit_for_bit(tmp_path):
    saved = _trainables(KINDS["onecycle"], OLD_LR, 1.0)
    directory = _checkpoint(tmp_path, saved)
    resumed = _trainables(KINDS["onecycle"], OLD_LR, 1.0)
    load_resumable(directory, resumed, OLD_LR, CPU)
    assert _lrs_of_steps(resumed, AFTER) == _lrs_of_steps(saved, AFTER)
