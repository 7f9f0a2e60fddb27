"""GPU: bf16 step time of raytrain (1 worker) vs a hand-tuned plain PyTorch loop (bf16
autocast, torch.compile, fused AdamW, pinned memory, loader processes), and the share of
time the GPU is busy, from torch.profiler over a window of training steps. Goals: ratio
<= 1.03 and raytrain's GPU busy share >= 90 %. Runs only where CUDA is available.

Each run trains ``EPOCHS`` epochs: the first is the warm-up (compilation, caches), the
next two are timed, the last one holds the profiled window (the profiler slows it down).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

import raytrain_app
from benchmarks.common import interleave, median, ratio_record, unique_name
from benchmarks.context import Context
from benchmarks.gpu_probe import StepProfiler
from benchmarks.workload import (
    GLOBAL_BATCH,
    GRAD_CLIP,
    LR,
    SEED,
    WEIGHT_DECAY,
    Workload,
    epoch_rows,
    lr_lambda,
    step_time,
    train_config,
)

logger = logging.getLogger(__name__)

GOAL_RATIO = 1.03
GOAL_BUSY_PERCENT = 90.0
EPOCHS = 4
TIMED_EPOCHS = slice(1, 3)  # epochs 2 and 3
PROFILE_STEPS = 50


def _profile_window(steps_per_epoch: int) -> tuple[int, int]:
    """Training-step calls to profile: early in the last epoch."""
    return (steps_per_epoch * (EPOCHS - 1) + 10, PROFILE_STEPS)


def raytrain_gpu(ctx: Context, round_index: int, steps_per_epoch: int) -> dict[str, Any]:
    ctx.local_ray.ensure()
    scratch = ctx.settings.scratch("gpu-raytrain")
    busy_file = scratch / "busy.json"
    start, count = _profile_window(steps_per_epoch)
    cfg = train_config(
        unique_name("gpu", round_index),
        ctx.runs_dir,
        workers=1,
        epochs=EPOCHS,
        data=ctx.data_params,
        model={
            "target": "benchmarks.gpu_probe:build",
            "params": {"busy_file": str(busy_file), "profile_from": start, "profile_steps": count},
        },
        precision="bf16",
        use_gpu=True,
    )
    result = raytrain_app.train(cfg, progress=False)
    rows = epoch_rows(result.run_dir)[TIMED_EPOCHS]
    busy = json.loads(busy_file.read_text())["busy_share"] if busy_file.is_file() else None
    return {"s_per_step": step_time(rows), "busy_share": busy}


def tuned_gpu(workload: Workload) -> dict[str, Any]:
    """The hand-tuned loop; per-step time of the timed epochs and the busy share."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda")
    splits, spec = workload.build()
    model = spec.module.to(device)
    compiled = torch.compile(model)
    loader = DataLoader(
        splits.train,
        batch_size=GLOBAL_BATCH,
        shuffle=True,
        drop_last=True,
        pin_memory=True,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(SEED),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    steps = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(steps * EPOCHS))
    profiler = StepProfiler(*_profile_window(steps))
    times = []
    for _ in range(EPOCHS):
        compiled.train()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for x, y in loader:
            profiler.before_call()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = spec.step(compiled, (x, y))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = times[TIMED_EPOCHS]
    return {"s_per_step": sum(timed) / (steps * len(timed)), "busy_share": profiler.result}


def run(ctx: Context) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU on this machine"}
    major, _ = torch.cuda.get_device_capability(0)
    if major < 8:
        return {
            "skipped": f"{torch.cuda.get_device_name(0)} has no bf16 (compute capability < 8.0)"
        }
    workload = ctx.workload()
    splits, _ = workload.build()
    steps = len(splits.train) // GLOBAL_BATCH
    results = interleave(
        {
            "raytrain_1_worker_bf16": lambda i: raytrain_gpu(ctx, i, steps),
            "hand_tuned_bf16": lambda i: tuned_gpu(workload),
        },
        ctx.settings.repeats,
    )
    record = ratio_record(
        candidate="raytrain_1_worker_bf16",
        baseline="hand_tuned_bf16",
        samples={k: [r["s_per_step"] for r in v] for k, v in results.items()},
        goal=GOAL_RATIO,
        unit="s per optimizer step",
        what=(
            f"bf16 step time on {torch.cuda.get_device_name(0)}, micro-batch {GLOBAL_BATCH}, "
            f"epochs 2-3 of {EPOCHS}; GPU busy share over {PROFILE_STEPS} profiled steps"
        ),
        runs=results,
    )
    busy = {
        k: median([r["busy_share"] for r in v if r["busy_share"] is not None] or [float("nan")])
        for k, v in results.items()
    }
    raytrain_busy = 100.0 * busy["raytrain_1_worker_bf16"]
    record.update(
        goal=f"<= {GOAL_RATIO}; GPU busy >= {GOAL_BUSY_PERCENT} %",
        goal_met=bool(record["goal_met"] and raytrain_busy >= GOAL_BUSY_PERCENT),
        gpu_busy_percent={k: round(100.0 * v, 1) for k, v in busy.items()},
        secondary=(
            f"GPU busy {raytrain_busy:.0f} % in raytrain, "
            f"{100.0 * busy['hand_tuned_bf16']:.0f} % hand-tuned"
        ),
    )
    return record
