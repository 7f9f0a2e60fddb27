"""torch.compile of the DDP-wrapped model on two real gloo ranks (no Ray), with gradient
accumulation: gradients are all-reduced once per optimizer step, bf16 autocast trains like
fp32, the step agreement still reaches both ranks, and the EMA is identical on both.

One spawn runs both trainings on both ranks: compiling is the slow part."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_on_two_ranks
from loop_harness import LocalSession, make_task, without_timings
from torch import nn

from raytrain_app.worker import model_setup
from raytrain_app.worker.loop import WorkerLoop, WorkerTask

EPOCHS, STEPS_PER_EPOCH, ACCUMULATION = 2, 16, 4
NAN_CALL = 6  # rank 1's 6th micro-batch: the 2nd optimizer step

_all_reduces = {"count": 0}


# No annotations: DDP checks a hook's against its classes, and this module's are strings.
def _count_all_reduces(state, bucket):
    """DDP's default all-reduce, counted once per gradient all-reduce (its last bucket)."""
    state["count"] += bucket.is_last()
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _register_counting_hook(model: nn.Module, kind: str, *args: object) -> None:
    if kind == "count" and isinstance(model, nn.parallel.DistributedDataParallel):
        model.register_comm_hook(_all_reduces, _count_all_reduces)


def _task(root: Path, precision: str) -> WorkerTask:
    task = make_task(
        root,
        epochs=EPOCHS,
        lr=0.03,
        max_batch_per_worker=32 // 2 // ACCUMULATION,
        on_nonfinite="skip",
        ema={"enabled": True, "decay": 0.9, "start_step": 2},
        model_params={"batchnorm": True, "nan_at_calls": [NAN_CALL], "nan_rank": 1},
        optimizations={"compile": True},
    )
    task.config["scaling"]["num_workers"] = 2
    task.config["precision"] = precision
    task.config["distributed"] = {"sync_batchnorm": False}  # buffers differ per rank
    task.plan = replace(
        task.plan,
        world_size=2,
        per_worker_batch_size=32 // 2 // ACCUMULATION,
        grad_accum_steps=ACCUMULATION,
        precision=precision,
        sync_batchnorm=False,
        # fp32: a counting hook owns the all-reduce; bf16: the flags ride on DDP's own.
        grad_compression="count" if precision == "fp32" else "none",
    )
    return task


def _rank(rank: int, tasks: dict[str, WorkerTask], root: str) -> dict:
    torch.set_num_threads(1)
    model_setup.register_comm_hook = _register_counting_hook
    runs = {}
    for precision, task in tasks.items():
        loop = WorkerLoop(task, LocalSession(Path(root) / f"{precision}-ckpt{rank}"))
        result = loop.run()
        runs[precision] = {
            "history": result["history"],
            "fused": loop.stepper.agreement.fused,
            "ema": loop.ema.module.state_dict(),
            "weights": loop.module.state_dict(),
        }
    runs["all_reduces"] = _all_reduces["count"]
    return runs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("compiled_ddp")
    tasks = {p: _task(root / p, p) for p in ("fp32", "bf16")}
    assert all(task.plan.compile for task in tasks.values())
    return run_on_two_ranks(functools.partial(_rank, tasks=tasks, root=str(root)), root)


def test_gradients_are_all_reduced_once_per_optimizer_step(ranks):
    # no_sync holds for the compiled model: not once per micro-batch (x ACCUMULATION).
    assert [r["all_reduces"] for r in ranks] == [EPOCHS * STEPS_PER_EPOCH] * 2


def test_compiled_ddp_trains_and_both_ranks_skip_a_nan_of_one(ranks):
    for precision in ("fp32", "bf16"):
        histories = [r[precision]["history"] for r in ranks]
        assert [row["skipped_steps"] for row in histories[0]] == [1, 0], precision
        assert without_timings(histories[0]) == without_timings(histories[1])  # global
        assert histories[0][-1]["train_loss"] < 0.9 * histories[0][0]["train_loss"]
        for key, value in ranks[0][precision]["weights"].items():
            if "running" not in key and "num_batches" not in key:  # BatchNorm is per rank
                assert torch.equal(ranks[1][precision]["weights"][key], value), key
    # The step agreement rides on DDP's gradient all-reduce under compile too.
    assert [r["bf16"]["fused"] for r in ranks] == [True, True]


def test_bf16_autocast_trains_like_fp32(ranks):
    fp32, bf16 = (ranks[0][p]["history"] for p in ("fp32", "bf16"))
    # bf16 keeps 8 bits of mantissa: 32 steps drift a few percent from fp32, not more.
    for row32, row16 in zip(fp32, bf16, strict=True):
        assert row16["train_loss"] == pytest.approx(row32["train_loss"], rel=0.1)
        assert row16["val_loss"] == pytest.approx(row32["val_loss"], rel=0.1)
    assert bf16[-1]["val_loss"] != fp32[-1]["val_loss"]  # autocast did run in bf16


def test_the_ema_is_identical_on_every_rank(ranks):
    # Each rank's BatchNorm statistics differ after its own forward (no SyncBatchNorm); the
    # EMA averages rank 0's, so its weights and buffers are the same on both ranks.
    for precision in ("fp32", "bf16"):
        ema = [r[precision]["ema"] for r in ranks]
        assert ema[0].keys() == ema[1].keys()
        for key, value in ema[0].items():
            assert torch.equal(ema[1][key], value), (precision, key)
