"""StepAgreement on two real gloo processes (no Ray): a flag set on one rank reaches both,
and both ranks get the step's items summed over the ranks, fused into DDP's gradient
all-reduce or on its own (a model with bf16 parameters is not fused: its buckets would
round the count), the fused gradients are the plain DDP's to the bit, and in the worker
loop both ranks act on the flags at the same step."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_on_two_ranks
from loop_harness import LocalSession, make_task
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_app.checkpoint import store as ckpt
from raytrain_app.worker import model_setup
from raytrain_app.worker.loop import NonFiniteLossError, WorkerLoop, WorkerTask
from raytrain_app.worker.step_agreement import AgreedFlags, StepAgreement
from raytrain_app.worker.stop_request import StopRequest

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
    agreed, items, grads = [], [], []
    for step, flags in enumerate(FLAGS):
        model.zero_grad(set_to_none=True)
        loss = model(inputs[step, rank]).square().mean()
        agreement.send(torch.tensor(flags[rank]), torch.tensor(_items(step, rank)))
        loss.backward()
        received = agreement.receive_flags()
        agreed.append(received.values())
        items.append(float(received.items))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return {"agreed": agreed, "items": items, "grads": torch.stack(grads)}


def _items(step: int, rank: int) -> float:
    return 1000.0 * step + 17 * rank + 3  # counts a bf16 sum would round


def _both_ways(rank: int) -> dict:
    torch.set_num_threads(1)
    bf16 = DistributedDataParallel(_model().to(torch.bfloat16))
    return {
        **{fuse: _steps(rank, fuse) for fuse in (True, False)},
        "bf16_fused": StepAgreement(bf16, world_size=2, fuse=True).fused,
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_on_two_ranks(_both_ways, tmp_path_factory.mktemp("agreement"))


@pytest.mark.parametrize("fuse", [True, False])
def test_a_flag_set_on_one_rank_reaches_every_rank(two_ranks, fuse):
    expected = [[any(column) for column in zip(*flags, strict=True)] for flags in FLAGS]
    assert two_ranks[0][fuse]["agreed"] == two_ranks[1][fuse]["agreed"] == expected


@pytest.mark.parametrize("fuse", [True, False])
def test_every_rank_gets_the_steps_items_summed_over_the_ranks(two_ranks, fuse):
    expected = [_items(step, 0) + _items(step, 1) for step in range(len(FLAGS))]
    assert two_ranks[0][fuse]["items"] == two_ranks[1][fuse]["items"] == expected
    assert not two_ranks[0]["bf16_fused"]


def test_fused_flags_leave_the_gradients_as_plain_ddp_averages_them(two_ranks):
    for rank in two_ranks:
        assert torch.equal(rank[True]["grads"], rank[False]["grads"])
    assert torch.equal(two_ranks[0][True]["grads"], two_ranks[1][True]["grads"])


def test_one_worker_needs_no_collective():
    agreement = StepAgreement(nn.Linear(2, 2), world_size=1, fuse=True)
    assert not agreement.fused
    agreement.send(torch.tensor([1.0, 0.0]))
    assert agreement.receive_flags().values() == [True, False]


# --------------------------------------------------------------------------- in the loop
# The worker loop on two gloo ranks, reading the flags at once (CPUs) and one step late
# (GPUs, forced here on CPU): a rank-local stop request or NaN leads both ranks to the same
# decision at the step step_agreement.py documents.

STOP_FROM_CALL = 3  # rank 1 alone sees the stop request from its 3rd step on


def _stop_seen_by_rank_one(self) -> bool:
    _stop_calls[0] += 1
    return dist.get_rank() == 1 and _stop_calls[0] >= STOP_FROM_CALL


_stop_calls = [0]


class _ReadLateOnCpu(StepAgreement):
    def __init__(self, model, world_size, fuse, read_late=False) -> None:
        super().__init__(model, world_size, fuse, read_late=True)


def _loop_task(root: Path, **train: object) -> WorkerTask:
    task = make_task(root, epochs=1, **train)
    task.config["scaling"]["num_workers"] = 2
    task.plan = replace(task.plan, world_size=2, per_worker_batch_size=16, grad_accum_steps=1)
    return task


def _outcome(task: WorkerTask, storage: Path) -> dict:
    session = LocalSession(storage)
    loop = WorkerLoop(task, session)
    try:
        result = loop.run()
        error = None
    except NonFiniteLossError as failed:
        result, error = {}, str(failed)
    return {
        "step": loop.state.step,
        "stopped": result.get("stopped", False),
        "skipped": [row.get("skipped_steps") for row in result.get("history", [])],
        "error": error,
        "checkpoints": sorted(ckpt.read_meta(c)["step"] for c in session.checkpoints()),
    }


def _loop_rank(rank: int, tasks: dict[str, WorkerTask], root: str) -> dict:
    torch.set_num_threads(1)
    outcomes = {}
    for late in (False, True):
        model_setup.StepAgreement = _ReadLateOnCpu if late else StepAgreement
        for name, task in tasks.items():
            _stop_calls[0] = 0
            with pytest.MonkeyPatch.context() as patch:
                if name == "stop":
                    patch.setattr(StopRequest, "requested", _stop_seen_by_rank_one)
                outcomes[name, late] = _outcome(task, Path(root) / f"{name}-{late}-{rank}")
    return outcomes


@pytest.fixture(scope="module")
def loop_ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("agreement_loop")
    nan = {"nan_at_calls": [8], "nan_rank": 1}  # rank 1's 8th step, a checkpointed one
    tasks = {
        "stop": _loop_task(root / "stop"),
        "nan_stop": _loop_task(root / "nan", checkpoint_every_steps=4, model_params=nan),
        "nan_skip": _loop_task(root / "skip", on_nonfinite="skip", model_params=nan),
    }
    work = functools.partial(_loop_rank, tasks=tasks, root=str(root))
    return run_on_two_ranks(work, root, timeout_s=120)


@pytest.mark.parametrize("late", [False, True], ids=["at_once", "one_step_late"])
def test_a_stop_request_on_one_rank_stops_both_at_the_same_step(loop_ranks, late):
    rank0, rank1 = (r["stop", late] for r in loop_ranks)
    # Read at once: both stop after the step in which rank 1 asked; read late, one after.
    expected_step = STOP_FROM_CALL + late
    assert rank0["stopped"] and rank1["stopped"]
    assert rank0["step"] == rank1["step"] == expected_step
    assert rank0["checkpoints"] == [expected_step]  # rank 0 wrote it, with both ranks' state


@pytest.mark.parametrize("late", [False, True], ids=["at_once", "one_step_late"])
def test_a_nan_on_one_rank_stops_both_before_checkpointing_it(loop_ranks, late):
    rank0, rank1 = (r["nan_stop", late] for r in loop_ranks)
    assert rank0["error"] == rank1["error"]
    assert "non-finite at step 8 (epoch 1, step 8 of 16)" in rank0["error"]
    assert rank0["checkpoints"] == [4]  # step 8 was due a checkpoint: never written


@pytest.mark.parametrize("late", [False, True], ids=["at_once", "one_step_late"])
def test_a_nan_on_one_rank_is_skipped_by_both(loop_ranks, late):
    rank0, rank1 = (r["nan_skip", late] for r in loop_ranks)
    assert rank0["skipped"] == rank1["skipped"] == [1]
    assert rank0["step"] == rank1["step"] == 16


def test_flags_on_cpu_are_read_without_waiting():
    flags = AgreedFlags(torch.tensor([0.0, 2.0]), read_late=False)
    assert flags.ready()  # nothing to wait for: no device copy
    assert (flags.nonfinite, flags.stop) == (False, True)
