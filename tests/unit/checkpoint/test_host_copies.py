"""The host copies a background checkpoint is written from (``snapshot.HostCopies``): each
is the state as it was when taken, in buffers kept from one checkpoint to the next, for as
many checkpoints as a run takes.

On an H100 with torch 2.11 the second checkpoint of every run failed (``KeyError: <class
'type'>``): the copies were made by DCP's ``DefaultStager``, which there closes its stager
after every copy. The test below gives the stager that behaviour on this machine's torch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint import staging

from raytrain_app.checkpoint.snapshot import HostCopies


def _trainables() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _train_step(model: nn.Module, optimizer, scheduler) -> None:
    model(torch.randn(16, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _state(model: nn.Module, optimizer, scheduler) -> dict:
    # As snapshot_resumable gathers it: state dicts, a class among the plain values.
    return {
        "model": model.state_dict(),
        "train_state": {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": 1,
            "kind": nn.Linear,
        },
    }


def _expected(state: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "exp_avg": state["train_state"]["optimizer"]["state"][0]["exp_avg"].clone(),
        "lr": state["train_state"]["scheduler"]["_last_lr"],
    }


def test_each_of_several_checkpoints_is_the_state_as_it_was_in_buffers_kept_between_them():
    model, optimizer, scheduler = _trainables()
    copies = HostCopies(pinned=False)
    buffers = []
    for _ in range(3):
        _train_step(model, optimizer, scheduler)
        state = _state(model, optimizer, scheduler)
        expected = _expected(state)
        copied = copies(state)
        _train_step(model, optimizer, scheduler)  # training goes on: the copy does not move

        for key, value in expected["model"].items():
            assert torch.equal(copied["model"][key], value), key
        assert not torch.equal(copied["model"]["0.weight"], model.state_dict()["0.weight"])
        exp_avg = copied["train_state"]["optimizer"]["state"][0]["exp_avg"]
        assert torch.equal(exp_avg, expected["exp_avg"])
        assert copied["train_state"]["scheduler"]["_last_lr"] == expected["lr"]
        assert copied["train_state"]["kind"] is nn.Linear
        # load_state_dict reads BatchNorm's version from the state dict's metadata.
        assert copied["model"]._metadata == state["model"]._metadata
        buffers.append(copied["model"]["0.weight"].data_ptr())
    assert len(set(buffers)) == 1  # one buffer per tensor, refilled
    copies.close()


def test_copies_do_not_depend_on_torch_2_11s_default_stager(monkeypatch):
    """torch 2.11's ``DefaultStager._stage`` closes its ``StateDictStager`` after every copy
    (2.13's does not); given that behaviour here, checkpoints after the first still copy."""
    original = staging.DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        staged = original(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(staging.DefaultStager, "_stage", stage_then_close)
    model, optimizer, scheduler = _trainables()
    copies = HostCopies(pinned=False)
    for _ in range(3):
        _train_step(model, optimizer, scheduler)
        state = _state(model, optimizer, scheduler)
        expected = _expected(state)
        copied = copies(state)
        assert torch.equal(copied["model"]["2.bias"], expected["model"]["2.bias"])
    copies.close()


def test_buffers_set_aside_ahead_are_copied_on_the_trainings_own_gpu(monkeypatch):
    """``prepare`` runs in the writer's thread, whose current GPU is the first one: it
    copies from (and waits for) the device the training runs on. The GPU is faked here:
    what is checked is which device the copy is made under."""
    entered = []

    class FakeDevice:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    model, optimizer, scheduler = _trainables()
    _train_step(model, optimizer, scheduler)
    copies = HostCopies(pinned=False)
    copies.prepare(_state(model, optimizer, scheduler), torch.device("cuda", 1))
    assert entered == [torch.device("cuda", 1)]
    # The buffers it set aside are the ones the next checkpoint refills.
    set_aside = copies._stager._cached_storage_mapping
    assert all(t.untyped_storage() in set_aside for t in model.state_dict().values())
    copies.prepare(_state(model, optimizer, scheduler), torch.device("cpu"))
    assert entered == [torch.device("cuda", 1)]  # on the CPU, no GPU is entered
    copies.close()
