"""StepAgreement on two real gloo processes (no Ray): a flag set on one rank reaches both,
fused into DDP's gradient all-reduce or on its own, and the fused gradients are the plain
DDP's to the bit."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_on_two_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_app.worker.step_agreement import StepAgreement

# Per step, the flags each rank sends: [a non-finite loss, a stop request].
FLAGS = [
    [[0.0, 0.0], [0.0, 0.0]],
    [[0.0, 0.0], [1.0, 0.0]],  # rank 1's loss went non-finite
    [[0.0, 1.0], [0.0, 0.0]],  # rank 0 saw the stop request
    [[1.0, 1.0], [1.0, 0.0]],
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Two gradient buckets, so the flags must pick the last one.
    return nn.Sequential(nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 2))


def _steps(rank: int, fuse: bool) -> dict:
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.2)
    agreement = StepAgreement(model, world_size=2, fuse=fuse)
    assert agreement.fused == fuse
    inputs = torch.randn(len(FLAGS), 2, 4, 300, generator=torch.Generator().manual_seed(1))
    agreed, grads = [], []
    for step, flags in enumerate(FLAGS):
        model.zero_grad(set_to_none=True)
        loss = model(inputs[step, rank]).square().mean()
        agreement.send(torch.tensor(flags[rank]))
        loss.backward()
        agreed.append(agreement.receive())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return {"agreed": agreed, "grads": torch.stack(grads)}


def _both_ways(rank: int) -> dict:
    torch.set_num_threads(1)
    return {fuse: _steps(rank, fuse) for fuse in (True, False)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_on_two_ranks(_both_ways, tmp_path_factory.mktemp("agreement"))


@pytest.mark.parametrize("fuse", [True, False])
def test_a_flag_set_on_one_rank_reaches_every_rank(two_ranks, fuse):
    expected = [[any(column) for column in zip(*flags, strict=True)] for flags in FLAGS]
    assert two_ranks[0][fuse]["agreed"] == two_ranks[1][fuse]["agreed"] == expected


def test_fused_flags_leave_the_gradients_as_plain_ddp_averages_them(two_ranks):
    for rank in two_ranks:
        assert torch.equal(rank[True]["grads"], rank[False]["grads"])
    assert torch.equal(two_ranks[0][True]["grads"], two_ranks[1][True]["grads"])


def test_one_worker_needs_no_collective():
    agreement = StepAgreement(nn.Linear(2, 2), world_size=1, fuse=True)
    assert not agreement.fused
    agreement.send(torch.tensor([1.0, 0.0]))
    assert agreement.receive() == [True, False]
