"""One GPU, through ``rt.train`` on a real Ray: what a new user with one GPU runs on day one.

The shipped quickstart and image configs with every ``auto`` left alone, so that on
compute capability >= 8.0 they train in bf16, compiled, with the memory probe and an EMA
(the two opt-ins a GPU user turns on: ``max_batch_per_worker: auto``, ``ema.enabled``);
compile with gradient checkpointing; FSDP in bf16 with a sharded save and a resume; fp16
with its GradScaler; the memory probe with BatchNorm.

Each model is wrapped in ``gpu_witness`` (tests/gpu/gpu_witness.py), whose record says
what the worker ran: the compiled model and the graphs dynamo built, the autocast dtype,
where the batches were, whether checkpointing was on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_configs import (
    EPOCHS,
    GLOBAL_BATCH,
    STEPS_PER_EPOCH,
    assert_learned,
    has_bf16,
    shipped,
    sine_config,
    without_timings,
    witnessed,
)
from gpu_witness import read_records

import raytrain_app as rt
from raytrain_app.checkpoint.sharded import has_sharded_state

needs_bf16 = pytest.mark.skipif(
    not has_bf16(), reason="the bf16 + compile defaults need compute capability >= 8.0"
)


def _assert_compiled_bf16_on_gpu(record: dict) -> None:
    """The worker trained a compiled model (dynamo built graphs of it) under bf16 autocast,
    on batches that were on the GPU."""
    assert "OptimizedModule" in record["model_types"], record
    assert record["unique_graphs"] >= 1, record
    assert record["autocast"] == "torch.bfloat16", record
    assert record["batch_devices"] == ["cuda"], record


def _defaults_run(cfg: dict, tmp_path: Path) -> tuple[rt.TrainResult, dict]:
    """``cfg`` with the memory probe and an EMA, its model witnessed; the plan checked to
    have resolved every ``auto`` as a compute capability >= 8.0 GPU should."""
    record_dir = tmp_path / f"{cfg['experiment']['name']}-record"
    cfg["model"] = witnessed(cfg["model"], record_dir)
    # The EMA's decay suits these short runs (at the default 0.999 their validation would
    # score mostly the initial weights).
    cfg["train"].update(max_batch_per_worker="auto", ema={"enabled": True, "decay": 0.99})
    plan = rt.plan(cfg)
    assert (plan.use_gpu, plan.precision, plan.backend) == (True, "bf16", "nccl")
    assert plan.compile and plan.memory_probe and plan.ema_decay is not None
    assert plan.gradient_checkpointing_auto and not plan.gradient_checkpointing
    result = rt.train(cfg, progress=False)
    (record,) = read_records(record_dir)
    assert (result.summary["precision"], result.summary["backend"]) == ("bf16", "nccl")
    _assert_compiled_bf16_on_gpu(record)
    # The EMA was kept: load_model finds its weights (and refuses a run without them).
    ema = rt.load_model(result.checkpoint, weights="ema", config=cfg)
    raw = rt.load_model(result.checkpoint, weights="raw", config=cfg)
    pairs = zip(ema.parameters(), raw.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)
    assert_learned(result, cfg)
    return result, record


@needs_bf16
def test_the_quickstart_trains_bf16_compiled_probed_with_an_ema(gpu_ray, tmp_path):
    cfg = shipped("quickstart.yaml", tmp_path)
    cfg["train"]["epochs"] = 3
    result, record = _defaults_run(cfg, tmp_path)
    # The transformer's micro-batch fits a GPU whole: no accumulation, no checkpointing.
    assert (result.summary["per_worker_batch_size"], result.summary["grad_accum_steps"]) == (64, 1)
    assert record["checkpointing"] is False


@needs_bf16
def test_the_image_workload_trains_bf16_compiled_probed_with_an_ema(gpu_ray, tmp_path):
    cfg = shipped("image.yaml", tmp_path)
    cfg["train"]["epochs"] = 3
    result, _ = _defaults_run(cfg, tmp_path)
    assert result.metrics[-1]["val_accuracy"] > 0.3  # chance is 0.1
    assert result.summary["per_worker_batch_size"] == cfg["train"]["global_batch_size"]


@needs_bf16
def test_compile_with_gradient_checkpointing_trains_the_resnet(gpu_ray, tmp_path):
    """What the memory probe switches on by itself when a batch does not fit (on CPU:
    tests/unit/worker/test_compiled_checkpointing.py), asked for here."""
    cfg = shipped("image.yaml", tmp_path)
    cfg["experiment"]["name"] = "checkpointed"
    cfg["train"]["epochs"] = 3
    cfg["optimizations"] = {"gradient_checkpointing": True}
    record_dir = tmp_path / "record"
    cfg["model"] = witnessed(cfg["model"], record_dir)
    plan = rt.plan(cfg)
    assert plan.compile and plan.gradient_checkpointing
    result = rt.train(cfg, progress=False)
    (record,) = read_records(record_dir)
    assert record["checkpointing"] is True
    _assert_compiled_bf16_on_gpu(record)
    assert result.metrics[-1]["val_accuracy"] > 0.3
    assert_learned(result, cfg)


@needs_bf16
def test_fsdp_in_bf16_saves_shards_and_a_killed_worker_resumes_from_them(gpu_ray, tmp_path):
    """FSDP2 on one GPU (torch shards over a mesh of one), bf16 by default. A checkpoint
    every 20 steps; the worker is SIGKILLed at its 70th step, Ray restarts it, and it
    resumes from the sharded checkpoint of step 60: its new process trains 90 steps."""
    marker = tmp_path / "killed"

    def config(name: str, **faults) -> tuple[dict, Path]:
        record_dir = tmp_path / f"{name}-record"
        cfg = sine_config(
            tmp_path,
            name,
            1,
            params=faults,
            train={"checkpoint_every_steps": 20},
            distributed={"strategy": "fsdp"},
            fault_tolerance={"max_failures": 1},
        )
        # the kill waits until the step-60 checkpoint, saved in the background, is recorded
        cfg["model"]["target"] = "paused_faults:build_model"
        cfg["model"] = witnessed(cfg["model"], record_dir)
        return cfg, record_dir

    straight_cfg, _ = config("straight")
    killed_cfg, record_dir = config(
        "killed",
        kill_rank=0,
        kill_at_call=70,
        marker=str(marker),
        checkpoints_dir=str(tmp_path / "killed" / "checkpoints" / "killed"),
        await_step=60,
    )
    plan = rt.plan(killed_cfg)
    assert (plan.strategy, plan.precision, plan.compile) == ("fsdp", "bf16", False)
    straight = rt.train(straight_cfg, progress=False)
    killed = rt.train(killed_cfg, progress=False)

    assert marker.exists(), "the worker was never killed"
    (record,) = read_records(record_dir)  # written last by the restarted worker
    assert record["calls"] == EPOCHS * STEPS_PER_EPOCH - 60
    assert any(name.startswith("FSDP") for name in record["model_types"]), record
    assert record["autocast"] == "torch.bfloat16"
    assert has_sharded_state(Path(killed.checkpoint))
    assert (killed.summary["strategy"], killed.summary["precision"]) == ("fsdp", "bf16")
    # The resume continued the run: the same epochs as the uninterrupted one, up to the
    # last bits of bf16 (resumed states and data order are exact).
    rows, reference = without_timings(killed.metrics), without_timings(straight.metrics)
    assert [row["step"] for row in rows] == [row["step"] for row in reference]
    for row, expected in zip(rows, reference, strict=True):
        assert row["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-3)
    assert_learned(straight, straight_cfg)
    assert_learned(killed, killed_cfg, restarted=True)


def test_fp16_trains_with_its_grad_scaler_over_nccl(gpu_ray, tmp_path):
    """fp16 autocast in the worker with the GradScaler on, including a micro-batch whose
    gradient overflows (its loss is finite); that the scaler skips that step and lowers
    its scale is shown in tests/gpu/test_gpu_in_process.py."""
    record_dir = tmp_path / "record"
    cfg = sine_config(tmp_path, "fp16", 1, params={"inf_grad_at_calls": [5]}, precision="fp16")
    cfg["model"] = witnessed(cfg["model"], record_dir)
    assert rt.plan(cfg).grad_scaler
    result = rt.train(cfg, progress=False)
    (record,) = read_records(record_dir)
    assert record["autocast"] == "torch.float16"
    assert result.summary["precision"] == "fp16"
    assert_learned(result, cfg)


def test_the_memory_probe_keeps_the_global_batch_with_batchnorm(gpu_ray, tmp_path):
    """``max_batch_per_worker: auto`` through Ray on CUDA, BatchNorm included: more than 8
    samples "run out of memory" (a stand-in raised after the forward), so the probe
    settles on 8 and accumulates. That a real CUDA allocation stops it, with the reserve
    for the optimizer held, is tests/gpu/test_gpu_in_process.py's."""
    cfg = sine_config(
        tmp_path,
        "probed",
        1,
        params={"batchnorm": True, "oom_above": 8},
        train={"max_batch_per_worker": "auto"},
    )
    assert rt.plan(cfg).memory_probe
    result = rt.train(cfg, progress=False)
    summary = result.summary
    assert summary["per_worker_batch_size"] == 8
    assert summary["grad_accum_steps"] == GLOBAL_BATCH // 8
    assert_learned(result, cfg)
