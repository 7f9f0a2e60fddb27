"""Faults a run survives with nothing lost, on a real Ray with 2 gloo workers.

Every interrupted run is compared with one uninterrupted run of the same config and seed:
the final metrics and weights must be bit-for-bit equal (fp32 on CPU, 2 workers: gloo sums
two gradients, which is order-independent, and every rank's RNG, sampler position and
partial epoch sums are restored from the checkpoint).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from fault_runs import (
    assert_same_as,
    fault_config,
)
from torch import nn

import raytrain_app as rt
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.errors import RunFailedError
from raytrain_app.workloads import FactoryRef, build_data

pytestmark = pytest.mark.distributed

EPOCHS = 4
STEPS_PER_EPOCH = 50  # 1601 train samples / global batch 32, the odd tail dropped


@pytest.fixture(scope="module")
def reference(fault_reference):
    """The uninterrupted run every fault is compared with (tests/conftest.py)."""
    return fault_reference


def test_uneven_splits_give_equal_steps_and_count_every_validation_sample(reference):
    assert [row["step"] for row in reference.metrics] == [
        STEPS_PER_EPOCH * epoch for epoch in range(1, EPOCHS + 1)
    ]
    meta = ckpt.read_meta(reference.checkpoint)
    splits = build_data(FactoryRef(**meta["data_factory"]), 5)
    assert len(splits.val) % 2 == 1
    model = rt.load_model(reference.checkpoint, trust_code=True)
    with torch.no_grad():
        x, y = splits.val.tensors
        loss = nn.functional.mse_loss(model(x), y).item()
    assert reference.metrics[-1]["val_loss"] == pytest.approx(loss, rel=1e-6)


def test_a_worker_killed_while_writing_a_checkpoint_restarts_and_loses_nothing(reference, tmp_path):
    """Rank 0, the one that writes checkpoints, is SIGKILLed one file into writing the
    step-70 checkpoint into the run's storage, while that save is in flight in its
    background writer and training has gone on (tests/support/workloads/checkpoint_kill.py):
    Ray restarts both workers from an older checkpoint, the torn copy is never loaded, step
    70 is written again whole, and the run ends bit-for-bit as the uninterrupted one."""
    marker = tmp_path / "killed.json"
    cfg = fault_config(tmp_path, "killed", kill_in_checkpoint_after_call=70, marker=str(marker))
    cfg["model"]["target"] = "checkpoint_kill:build_model"
    cfg["data"]["target"] = "checkpoint_kill:build_data"
    cfg["fault_tolerance"]["max_failures"] = 1
    result = rt.train(cfg, progress=False)
    assert marker.exists(), "the worker was never killed"
    killed = json.loads(marker.read_text())
    # 1601 train samples / 32: 50 steps an epoch, so step 70 is 20 steps into epoch 2.
    assert Path(killed["partial"]).name == ckpt.checkpoint_name(1, 70) + ".partial"
    # The weights whole; the second file begun (its .tmp, opened before torch.save), no more.
    assert killed["written"] == [ckpt.MODEL_FILE, ckpt.TRAIN_STATE_FILE + ".tmp"]
    assert killed["trained"] > 70, "training waited for the save (train.async_checkpoints)"
    assert result.summary["status"] == "completed"
    checkpoints = result.run_dir / "checkpoints"
    assert not list(checkpoints.glob("**/*.partial")), "the torn copy was left behind"
    assert_same_as(result.run_dir, reference)
    # The run's time: the restart and the steps 60 to 70, trained twice, are counted.
    goodput = result.summary["goodput"]
    assert goodput["restart_s"] > 0 and goodput["lost_work_s"] > 0, goodput
    assert sum(goodput.values()) == pytest.approx(result.summary["wall_time_s"], rel=0.02)


def test_a_nan_on_one_rank_skips_that_step_on_every_rank(ray_cluster, tmp_path):
    cfg = fault_config(tmp_path, "nan", epochs=2, nan_rank=1, nan_at_calls=[60])
    cfg["train"]["on_nonfinite"] = "skip"
    result = rt.train(cfg, progress=False)
    # Rank 1's 60th micro-batch is step 60, in epoch 2; had rank 0 stepped alone, the
    # ranks' weights would differ and DDP would not notice, so the agreement is the point.
    assert [row["skipped_steps"] for row in result.metrics] == [0, 1]
    assert all(
        torch.isfinite(p).all() for p in rt.load_model(result.run_dir, trust_code=True).parameters()
    )
    assert result.metrics[-1]["train_loss"] < result.metrics[0]["train_loss"]


def test_a_hung_collective_fails_the_run_after_distributed_timeout_s(ray_cluster, tmp_path):
    cfg = fault_config(tmp_path, "hung", hang_rank=1, hang_at_call=3)
    cfg["distributed"] = {"timeout_s": 5}
    start = time.monotonic()
    with pytest.raises(RunFailedError, match=r"distributed\.timeout_s=5 s") as info:
        rt.train(cfg, progress=False)
    assert "\n" not in str(info.value)
    assert time.monotonic() - start < 120  # not Ray's 30 minutes, not torch's 10


# --------------------------------------------------------------------------- the driver


# --------------------------------------------------------------------------- compression


def test_workers_run_at_nice_0_with_the_step_agreement_in_ddps_all_reduce(fault_reference):
    # Recorded by rank 0 of the session's reference run (the default settings).
    seen = json.loads((fault_reference.run_dir.parent / "hooks.json").read_text())
    # Ray starts worker processes at nice 15, behind every other process on the node.
    assert seen["niceness"] == 0
    # The per-step flags ride in DDP's last gradient bucket: no all-reduce of their own.
    assert seen["hooks"] == ["_all_reduce_with_flags"]


def test_powersgd_compression_trains_and_communicates_once_per_optimizer_step(
    ray_cluster, tmp_path
):
    record = tmp_path / "hooks.json"
    cfg = fault_config(tmp_path, "powersgd", record_comm_hooks=str(record))
    cfg["train"].update({"epochs": 2, "max_batch_per_worker": 8})  # 2 micro-batches a step
    cfg["distributed"] = {"grad_compression": "powersgd", "start_powersgd_iter": 2}
    result = rt.train(cfg, progress=False)
    assert result.summary["grad_accum_steps"] == 2
    seen = json.loads(record.read_text())
    assert seen["hooks"] == ["powerSGD_hook"]
    # Recorded before the last micro-batch of the last step: one all-reduce per finished
    # optimizer step, none for the accumulation micro-batches under no_sync.
    assert seen["calls"] == 2 * STEPS_PER_EPOCH * 2
    assert seen["iter"] == [2 * STEPS_PER_EPOCH - 1]
    losses = [row["train_loss"] for row in result.metrics]
    assert losses[-1] < losses[0]
