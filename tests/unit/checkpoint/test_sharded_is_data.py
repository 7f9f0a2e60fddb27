"""A sharded (FSDP) checkpoint is data: a resume from a planted pickle runs nothing.

DCP pickles what is not a tensor (the optimizer's ``param_groups``: betas, eps, ...) into
the ``.distcp`` files, and its default planner unpickles them with
``torch.load(weights_only=False)``. Each test writes a real FSDP checkpoint in this process
(a one-rank gloo group, FSDP2, AdamW), edits it as anyone who can write the run directory
could (DCP's own writer, ``manifest.json`` recomputed), and resumes through the workers'
path (``load_resumable``). The payloads only ever create a marker file.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from raytrain_app.checkpoint.sharded import SHARDED_METADATA_FILE, has_sharded_state
from raytrain_app.checkpoint.store import write_manifest
from raytrain_app.checkpoint.train_state import (
    LoopState,
    Trainables,
    load_resumable,
    rng_state,
    save_resumable,
)
from raytrain_app.errors import BadInputError

CPU = torch.device("cpu")


class _Payload:
    """A pickle that runs a process when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory) -> Iterator[None]:
    """A gloo process group of one rank, so that FSDP2 shards (over one rank) as it does in
    a worker."""
    store = tmp_path_factory.mktemp("group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trainables(seed: int) -> Trainables:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Trainables(model, model, optimizer, scheduler, scaler, None)


def _checkpoint(tmp_path: Path) -> tuple[Path, Trainables]:
    """A sharded checkpoint after three steps, as a worker writes it."""
    saved = _trainables(seed=0)
    for _ in range(3):
        saved.model(torch.randn(16, 3)).pow(2).mean().backward()
        saved.optimizer.step()
        saved.optimizer.zero_grad()
        saved.scheduler.step()
    directory = tmp_path / "checkpoint_epoch0001_step000000003"
    ranks = [{"rng": rng_state(), "epoch": {"sums": {}, "elapsed_s": 1.0, "skipped_steps": 0}}]
    save_resumable(directory, saved, LoopState(epoch=1, step=3), ranks, meta={})
    assert has_sharded_state(directory)
    return directory, saved


def _plant(directory: Path, trainables: Trainables, group_key: str, payload: object) -> None:
    """Rewrite the shards with ``payload`` as the optimizer's ``param_groups[0][group_key]``
    (an item DCP pickles), and the manifest to match."""
    model_state, optimizer_state = get_state_dict(trainables.model, trainables.optimizer)
    optimizer_state["param_groups"][0][group_key] = payload
    for shard in [directory / SHARDED_METADATA_FILE, *directory.glob("*.distcp")]:
        shard.unlink()  # replaced, as DCP's writer warns it would overwrite
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))
    write_manifest(directory)


def _one_line_refusal(directory: Path) -> str:
    with pytest.raises(BadInputError) as refused:
        load_resumable(directory, _trainables(seed=1), lr=None, device=CPU)
    message = str(refused.value)
    assert "\n" not in message and "experiment.name" in message, message
    return message


def test_a_genuine_sharded_checkpoint_resumes_exactly(tmp_path):
    directory, saved = _checkpoint(tmp_path)
    fresh = _trainables(seed=1)

    load_resumable(directory, fresh, lr=None, device=CPU)

    for group, restored in zip(
        saved.optimizer.param_groups, fresh.optimizer.param_groups, strict=True
    ):
        assert {k: v for k, v in restored.items() if k != "params"} == {
            k: v for k, v in group.items() if k != "params"
        }
    assert fresh.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    saved_state, fresh_state = saved.optimizer.state_dict(), fresh.optimizer.state_dict()
    for key, moments in saved_state["state"].items():
        assert all(torch.equal(moments[n], fresh_state["state"][key][n]) for n in moments)
    for name, tensor in saved.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name].full_tensor(), tensor.full_tensor())


def test_a_pickle_planted_in_the_shards_runs_nothing_on_resume(tmp_path):
    directory, saved = _checkpoint(tmp_path)
    marker = tmp_path / "marker"
    _plant(directory, saved, "eps", _Payload(marker))

    message = _one_line_refusal(directory)

    assert "__0_0.distcp' holds its item 'optimizer.param_groups.0.eps'" in message, message
    assert "posix.system" in message, message
    assert not marker.exists()


def test_a_planted_metadata_pickle_is_one_line_on_resume(tmp_path):
    """``.metadata`` is unpickled with DCP's classes only; the refusal reaches the resume as
    one line (inside ``dcp.load`` it was retried and wrapped into DCP's traceback)."""
    directory, _ = _checkpoint(tmp_path)
    marker = tmp_path / "marker"
    (directory / SHARDED_METADATA_FILE).write_bytes(pickle.dumps(_Payload(marker)))
    write_manifest(directory)

    message = _one_line_refusal(directory)

    assert f"{SHARDED_METADATA_FILE}' is not a sharded checkpoint's metadata" in message, message
    assert "names posix.system" in message, message
    assert not marker.exists()
