"""Two GPUs, through ``rt.train`` on a real Ray over nccl: what needs ranks on separate
devices. torch.compile of DDP with accumulation (the gradients all-reduced once per
optimizer step), fp16/bf16 gradient compression, 1 against 2 GPUs and FSDP against DDP,
and the memory probe agreeing across ranks.

Marked ``needs_two_gpus``: skipped, and left out of ``-m gpu``, on a machine with fewer
(tests/gpu/conftest.py). Every run is the ``faults`` sine regression: seconds each.
"""

from __future__ import annotations

import json

import pytest
import torch
from gpu_configs import (
    EPOCHS,
    GLOBAL_BATCH,
    STEPS_PER_EPOCH,
    assert_learned,
    has_bf16,
    sine_config,
    witnessed,
)
from gpu_witness import read_records
from torch import nn

import raytrain_app as rt

pytestmark = pytest.mark.needs_two_gpus


def test_compile_of_ddp_with_accumulation_all_reduces_once_per_step_over_nccl(gpu_ray, tmp_path):
    """Each rank trains the compiled DDP model (dynamo built its graphs), 2 micro-batches
    a step, and DDP all-reduces the gradients once per optimizer step: ``no_sync`` holds
    under compile."""
    record_dir = tmp_path / "record"
    cfg = sine_config(
        tmp_path,
        "compiled",
        2,
        train={"max_batch_per_worker": 8},  # 16 per worker: 2 micro-batches a step
        optimizations={"compile": True},
    )
    cfg["model"] = witnessed(cfg["model"], record_dir, count_all_reduces=True)
    result = rt.train(cfg, progress=False)
    summary = result.summary
    assert (summary["backend"], summary["strategy"]) == ("nccl", "ddp")
    assert (summary["per_worker_batch_size"], summary["grad_accum_steps"]) == (8, 2)
    records = read_records(record_dir)
    assert len(records) == 2
    for record in records:
        assert "OptimizedModule" in record["model_types"], record
        assert record["unique_graphs"] >= 1, record
        assert record["calls"] == EPOCHS * STEPS_PER_EPOCH * 2
        assert record["all_reduces"] == EPOCHS * STEPS_PER_EPOCH
    assert_learned(result, cfg)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_fp16_and_bf16_gradient_compression_over_nccl(gpu_ray, tmp_path, compression):
    if compression == "bf16" and not has_bf16():
        pytest.skip("bf16 needs compute capability >= 8.0")
    record = tmp_path / "hooks.json"
    cfg = sine_config(
        tmp_path,
        f"compressed-{compression}",
        2,
        params={"record_comm_hooks": str(record)},
        distributed={"grad_compression": compression},
    )
    result = rt.train(cfg, progress=False)
    assert result.summary["backend"] == "nccl"
    assert json.loads(record.read_text())["hooks"] == [f"{compression}_compress_hook"]
    assert_learned(result, cfg)


def test_one_and_two_gpus_agree_and_fsdp_matches_ddp(gpu_ray, tmp_path):
    """fp32, no dropout: the same global batches in the same order on 1 and 2 GPUs, so the
    runs differ only by the order of float sums (and TF32 matmuls on Ampere)."""
    configs = {
        name: sine_config(
            tmp_path, name, workers, precision="fp32", distributed={"strategy": strategy}
        )
        for name, workers, strategy in [
            ("one-gpu", 1, "ddp"),
            ("two-gpus", 2, "ddp"),
            ("fsdp", 2, "fsdp"),
        ]
    }
    runs = {name: rt.train(cfg, progress=False) for name, cfg in configs.items()}
    assert runs["fsdp"].summary["strategy"] == "fsdp"
    val = {name: run.metrics[-1]["val_loss"] for name, run in runs.items()}
    assert val["two-gpus"] == pytest.approx(val["one-gpu"], rel=1e-2)
    assert val["fsdp"] == pytest.approx(val["two-gpus"], rel=1e-3)
    for name, run in runs.items():
        assert_learned(run, configs[name])
    # FSDP's checkpoint loads as a plain module, with DDP's weights up to rounding.
    sharded = rt.load_model(runs["fsdp"].run_dir, config=configs["fsdp"])
    replicated = rt.load_model(runs["two-gpus"].run_dir, config=configs["two-gpus"])
    assert type(sharded) is nn.Sequential
    for key, tensor in replicated.state_dict().items():
        torch.testing.assert_close(sharded.state_dict()[key], tensor, rtol=1e-2, atol=1e-3)


def test_the_memory_probe_agrees_on_the_smallest_fit_of_two_ranks(gpu_ray, tmp_path):
    """``max_batch_per_worker: auto`` with SyncBatchNorm on 2 GPUs: rank 0 "runs out of
    memory" above 16 samples and rank 1 above 8 (a stand-in raised after the forward), so
    both settle on 8 and keep the global batch by accumulating."""
    cfg = sine_config(
        tmp_path,
        "probed-2",
        2,
        params={"batchnorm": True, "oom_above": [16, 8]},
        train={"max_batch_per_worker": "auto"},
    )
    plan = rt.plan(cfg)
    assert plan.memory_probe and plan.sync_batchnorm
    result = rt.train(cfg, progress=False)
    summary = result.summary
    assert summary["per_worker_batch_size"] == 8
    assert summary["grad_accum_steps"] == GLOBAL_BATCH // 2 // 8
    assert_learned(result, cfg)
