"""What a checkpoint carries for an exact resume: everything saved comes back, the current
lr wins, and a checkpoint of another world size still resumes with exact epoch sums."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.train_state import (
    LoopState,
    Trainables,
    load_resumable,
    restore_cuda_rng,
    rng_state,
    save_resumable,
)
from raytrain_app.worker.model_companions import make_ema
from raytrain_app.worker.rank_zero import set_rank

CPU = torch.device("cpu")


def _trainables(seed: int, loss_scaling: bool = True) -> Trainables:
    """``loss_scaling``: the GradScaler is on, as for fp16 (off for fp32 and bf16)."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    scaler = torch.amp.GradScaler("cpu", enabled=loss_scaling)
    return Trainables(module, module, optimizer, scheduler, scaler, make_ema(module, 0.9), 0.01)


def _train(t: Trainables, steps: int) -> None:
    for _ in range(steps):
        t.module(torch.randn(16, 4)).pow(2).mean().backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        t.scheduler.step()
        t.ema.update_parameters(t.module)


def _rank_part(sums: dict[str, float], elapsed_s: float) -> dict:
    return {
        "rng": rng_state(),
        "epoch": {"sums": sums, "elapsed_s": elapsed_s, "skipped_steps": 1},
    }


def _save(tmp_path, t: Trainables, ranks: list[dict]):
    state = LoopState(epoch=1, step=7, history=[{"epoch": 1.0}], step_in_epoch=3, skipped_steps=1)
    directory = tmp_path / ckpt.checkpoint_name(state.epoch, state.step)
    save_resumable(directory, t, state, ranks, meta={"epoch": 1, "step": 7})
    return directory, state


def test_everything_saved_comes_back_and_the_current_lr_wins(tmp_path):
    saved = _trainables(seed=0)
    _train(saved, steps=5)
    directory, state = _save(tmp_path, saved, [_rank_part({"loss": 2.0, "count": 4.0}, 1.5)])

    fresh = _trainables(seed=1)
    resumed = load_resumable(directory, fresh, lr=0.05, device=CPU)

    assert resumed.state == state and resumed.directory == directory
    for a, b in [(saved.module, fresh.module), (saved.ema.module, fresh.ema.module)]:
        expected, found = a.state_dict(), b.state_dict()
        assert all(torch.equal(expected[key], found[key]) for key in expected)
    assert int(fresh.ema.n_averaged) == 5
    for key, moments in saved.optimizer.state_dict()["state"].items():
        restored = fresh.optimizer.state_dict()["state"][key]
        assert all(torch.equal(moments[name], restored[name]) for name in moments)
    assert fresh.scheduler.last_epoch == 5
    # A PBT trial continuing another trial's checkpoint trains with its own (mutated) lr.
    assert fresh.scheduler.base_lrs == [pytest.approx(0.05)]
    fresh.scheduler.step()
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / 7)


def test_each_rank_gets_its_own_random_streams_and_epoch_sums_back(tmp_path):
    ranks = []
    for rank in range(2):
        torch.manual_seed(100 + rank)
        ranks.append(_rank_part({"loss": 1.0 + rank, "count": 4.0}, 2.0 + rank))
    directory, _ = _save(tmp_path, _trainables(seed=0), ranks)
    resumed = load_resumable(directory, _trainables(seed=0), lr=0.01, device=CPU)

    for rank in range(2):
        torch.manual_seed(0)
        assert resumed.restore_rank(rank, world_size=2) == ranks[rank]["epoch"]
        assert torch.equal(torch.get_rng_state(), ranks[rank]["rng"]["torch"])


def test_a_checkpoint_of_two_workers_resumes_on_one_with_the_whole_epoch_sums(tmp_path, caplog):
    ranks = [
        _rank_part({"loss": 1.0, "count": 4.0}, 2.0),
        _rank_part({"loss": 3.0, "count": 4.0}, 2.5),
    ]
    directory, _ = _save(tmp_path, _trainables(seed=0), ranks)
    resumed = load_resumable(directory, _trainables(seed=0), lr=0.01, device=CPU)

    set_rank(0)
    with caplog.at_level(logging.INFO, logger="raytrain_app.checkpoint.train_state"):
        epoch = resumed.restore_rank(0, world_size=1)
    # A global step covers the same samples for any world size, so rank 0 carries them all.
    assert epoch == {"sums": {"loss": 4.0, "count": 8.0}, "elapsed_s": 2.5, "skipped_steps": 1}
    assert "written by 2 workers, this run has 1" in caplog.text


def test_a_worker_restores_its_own_cuda_state_whatever_the_gpus_it_saw():
    """Each worker saves its own device's CUDA state; a checkpoint of an earlier version
    holds every GPU the worker saw. A resume on fewer GPUs must not index past them."""
    states = [torch.full((4,), i, dtype=torch.uint8) for i in range(4)]
    restored: list[torch.Tensor] = []
    restore_cuda_rng(states[2], 0, restored.append)  # its own device's state, any index
    restore_cuda_rng(states, 1, restored.append)  # 4 GPUs saved, device 1 of 1 or 2 now
    assert [int(s[0]) for s in restored] == [2, 1]
    restore_cuda_rng(states[:1], 3, restored.append)  # more GPUs now: the stream restarts
    assert len(restored) == 2


@pytest.mark.parametrize(
    ("saved_scaling", "resumed_scaling"),
    [(False, True), (True, False), (True, True)],
    ids=["fp32-to-fp16", "fp16-to-bf16", "fp16-to-fp16"],
)
def test_a_checkpoint_resumes_across_a_change_of_loss_scaling(
    tmp_path, caplog, saved_scaling, resumed_scaling
):
    """A Tune PBT trial may continue another trial's checkpoint with ``precision`` mutated.
    A disabled scaler saves ``{}``, which torch refused to load into an enabled one."""
    saved = _trainables(seed=0, loss_scaling=saved_scaling)
    if saved_scaling:  # a scale the run had lowered, which a resume in fp16 continues from
        saved.scaler.scale(torch.ones(()))
        saved.scaler.update(new_scale=1024.0)
    directory, state = _save(tmp_path, saved, [_rank_part({"loss": 1.0}, 1.0)])

    fresh = _trainables(seed=1, loss_scaling=resumed_scaling)
    with caplog.at_level(logging.INFO, logger="raytrain_app.checkpoint.train_state"):
        resumed = load_resumable(directory, fresh, lr=0.01, device=CPU)

    assert resumed.state == state  # everything else came back as ever
    assert fresh.scaler.is_enabled() is resumed_scaling
    if not resumed_scaling:  # a disabled scaler ignores the saved state
        assert fresh.scaler.state_dict() == {}
    elif saved_scaling:
        assert fresh.scaler.get_scale() == 1024.0
    else:  # nothing to continue from: the initial scale, and one line saying why
        assert fresh.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
        assert "written without fp16 loss scaling" in caplog.text
