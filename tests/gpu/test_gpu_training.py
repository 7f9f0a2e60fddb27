"""What only a CUDA GPU runs: bf16 and fp16 + GradScaler, torch.compile of DDP with
accumulation, FSDP, nccl with fp16/bf16 gradient compression, and the memory probe, each
through ``rt.train`` on a real Ray with 1 or 2 GPUs (2-GPU tests skip with fewer).

The CPU tiers run the same code paths where torch can (gloo, CPU autocast); these tests are
the proof on the hardware the defaults are chosen for. Every run is the ``faults`` sine
regression (tests/support/workloads/faults.py): small, so each takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import raytrain_app as rt

GLOBAL_BATCH = 32
EPOCHS = 3
STEPS_PER_EPOCH = 50  # 1601 train samples / global batch 32


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip a test on a machine with fewer than ``count`` CUDA GPUs."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < count, reason=f"needs {count} CUDA GPUs, {have} visible")


def has_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 0)


def gpu_config(
    output_dir: Path, name: str, workers: int, params: dict | None = None, **overrides: Any
) -> dict:
    """3 epochs of the sine regression on ``workers`` GPUs. ``params`` add to the model's;
    a dict in ``overrides`` updates that section key by key, any other value replaces it."""
    cfg: dict[str, Any] = {
        "experiment": {"name": name, "output_dir": str(output_dir), "seed": 5},
        "model": {"target": "faults:build_model", "params": {"hidden": 64, **(params or {})}},
        "data": {"target": "faults:build_data", "params": {"num_samples": 2002}},
        "train": {"epochs": EPOCHS, "global_batch_size": GLOBAL_BATCH, "lr": 0.01},
        "scaling": {"num_workers": workers, "use_gpu": True},
        "dataloader": {"num_workers": 0},
        "optimizations": {"compile": False},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def assert_learned(result: rt.TrainResult) -> None:
    """Finite weights and a validation loss that went down."""
    losses = [row["val_loss"] for row in result.metrics]
    assert losses[-1] < losses[0], losses
    model = rt.load_model(result.run_dir)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --------------------------------------------------------------------------- precision


@needs_gpus(1)
@pytest.mark.skipif(not has_bf16(), reason="bf16 needs compute capability >= 8.0")
def test_bf16_is_the_default_on_ampere_and_trains(gpu_ray, tmp_path):
    result = rt.train(gpu_config(tmp_path, "bf16", 1), progress=False)
    summary = result.summary
    assert (summary["precision"], summary["backend"]) == ("bf16", "nccl")
    assert_learned(result)


@needs_gpus(1)
def test_fp16_with_grad_scaler_skips_an_overflowing_step_and_trains(gpu_ray, tmp_path):
    # Micro-batch 5's gradient is infinite (its loss is finite): the scaler must skip that
    # step and lower its scale instead of writing inf into the weights.
    cfg = gpu_config(tmp_path, "fp16", 1, params={"inf_grad_at_calls": [5]}, precision="fp16")
    assert rt.plan(cfg).grad_scaler
    result = rt.train(cfg, progress=False)
    assert result.summary["precision"] == "fp16"
    assert_learned(result)


# --------------------------------------------------------------------------- 2 GPUs


@needs_gpus(2)
def test_compile_of_ddp_with_accumulation_trains_over_nccl(gpu_ray, tmp_path):
    record = tmp_path / "hooks.json"
    cfg = gpu_config(
        tmp_path,
        "compiled",
        2,
        params={"record_comm_hooks": str(record)},
        train={"max_batch_per_worker": 8},  # 16 per worker: 2 micro-batches a step
        optimizations={"compile": True},
    )
    result = rt.train(cfg, progress=False)
    summary = result.summary
    assert (summary["backend"], summary["strategy"]) == ("nccl", "ddp")
    assert (summary["per_worker_batch_size"], summary["grad_accum_steps"]) == (8, 2)
    assert json.loads(record.read_text())["calls"] == EPOCHS * STEPS_PER_EPOCH * 2
    assert_learned(result)


@needs_gpus(2)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_fp16_and_bf16_gradient_compression_over_nccl(gpu_ray, tmp_path, compression):
    if compression == "bf16" and not has_bf16():
        pytest.skip("bf16 needs compute capability >= 8.0")
    record = tmp_path / "hooks.json"
    cfg = gpu_config(
        tmp_path,
        f"compressed-{compression}",
        2,
        params={"record_comm_hooks": str(record)},
        distributed={"grad_compression": compression},
    )
    result = rt.train(cfg, progress=False)
    assert result.summary["backend"] == "nccl"
    assert json.loads(record.read_text())["hooks"] == [f"{compression}_compress_hook"]
    assert_learned(result)


@needs_gpus(2)
def test_one_and_two_gpus_agree_and_fsdp_matches_ddp(gpu_ray, tmp_path):
    """fp32, no dropout: the same global batches in the same order on 1 and 2 GPUs, so the
    runs differ only by the order of float sums (and TF32 matmuls on Ampere)."""
    runs = {
        name: rt.train(
            gpu_config(
                tmp_path, name, workers, precision="fp32", distributed={"strategy": strategy}
            ),
            progress=False,
        )
        for name, workers, strategy in [
            ("one-gpu", 1, "ddp"),
            ("two-gpus", 2, "ddp"),
            ("fsdp", 2, "fsdp"),
        ]
    }
    assert runs["fsdp"].summary["strategy"] == "fsdp"
    val = {name: run.metrics[-1]["val_loss"] for name, run in runs.items()}
    assert val["two-gpus"] == pytest.approx(val["one-gpu"], rel=1e-2)
    assert val["fsdp"] == pytest.approx(val["two-gpus"], rel=1e-3)
    for run in runs.values():
        assert_learned(run)
    # FSDP's checkpoint loads as a plain module, with DDP's weights up to rounding.
    sharded = rt.load_model(runs["fsdp"].run_dir)
    replicated = rt.load_model(runs["two-gpus"].run_dir)
    assert type(sharded) is nn.Sequential
    for key, tensor in replicated.state_dict().items():
        torch.testing.assert_close(sharded.state_dict()[key], tensor, rtol=1e-2, atol=1e-3)


# --------------------------------------------------------------------------- memory probe


@pytest.mark.parametrize(
    "workers", [pytest.param(1, marks=needs_gpus(1)), pytest.param(2, marks=needs_gpus(2))]
)
def test_the_memory_probe_picks_the_largest_micro_batch_that_fits(gpu_ray, tmp_path, workers):
    """``max_batch_per_worker: auto`` on real CUDA, BatchNorm included (SyncBatchNorm on 2
    GPUs); more than 8 samples "run out of memory" (a stand-in raised after the forward, as
    the real error would be), so the probe settles on 8 and keeps the global batch."""
    cfg = gpu_config(
        tmp_path,
        f"probed-{workers}",
        workers,
        params={"batchnorm": True, "oom_above": 8},
        train={"max_batch_per_worker": "auto"},
    )
    assert rt.plan(cfg).memory_probe
    result = rt.train(cfg, progress=False)
    summary = result.summary
    assert summary["per_worker_batch_size"] == 8
    assert summary["grad_accum_steps"] == GLOBAL_BATCH // workers // 8
    assert_learned(result)
