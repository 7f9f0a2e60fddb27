"""Checkpoint stall: the training time a mid-epoch checkpoint costs a ~100M-parameter model
on 2 CPU workers, in steps. Goal: at most 1 step per checkpoint with checkpoints saved in
the background (``train.async_checkpoints``, the default).

One epoch of ``STEPS`` optimizer steps of a 24-layer 2048-wide MLP (100.7 M parameters,
AdamW: a checkpoint of about 1.2 GB), global batch 16, five ways in every round, in the
same Ray: no mid-epoch checkpoint (the baseline), a checkpoint every ``EVERY`` steps saved
on the step's path (``async_checkpoints: false``, as raytrain did before), one saved in
the background, and the baseline and the background run on one worker (a core left to the
writer). A checkpoint's cost is the epoch's training time (``epoch_time_s``) over
the baseline's, plus what the epoch-end checkpoint waited for a save still in flight
(its ``meta.json``) over the baseline's, divided by the checkpoints, in units of the
baseline's step time. Every run also ends with the epoch-end checkpoint, outside the
epoch's time, so it cancels out.
"""

from __future__ import annotations

import json
import logging
import shutil
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import raytrain_app
from benchmarks.common import (
    QUIET_PERCENT,
    CpuWatch,
    foreign_percent,
    median,
    unique_name,
    wait_until_quiet,
)
from benchmarks.context import Context
from raytrain_app import DataSplits, ModelSpec, StepOutput
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.tracking.metrics_log import read_metrics

logger = logging.getLogger(__name__)

GOAL = 1.0  # steps lost per checkpoint
STEPS, EVERY, GLOBAL_BATCH = 40, 10, 16
WIDTH, LAYERS = 2048, 24  # 24 x (2048 x 2048 + 2048) + 2049 = 100.7 M parameters
QUICK_WIDTH, QUICK_STEPS = 1024, 20  # --quick: a quarter of the model, half the steps
# name: (train.async_checkpoints, workers); None: no mid-epoch checkpoint. The "spare" pair
# trains on one worker, which leaves the second core to the writer, as a GPU host's CPUs
# are mostly free while its GPUs train.
VARIANTS = {
    "none": (None, 2),
    "sync": (False, 2),
    "async": (True, 2),
    "none-spare": (None, 1),
    "async-spare": (True, 1),
}


def build_model(params: dict, data_info: dict) -> ModelSpec:
    """Protocol model factory: ``layers`` x (Linear(width, width), tanh), then a scalar."""
    width, layers = int(data_info["width"]), int(params.get("layers", LAYERS))
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    module = nn.Sequential(*blocks, nn.Linear(width, 1))

    def step(model: nn.Module, batch) -> StepOutput:
        x, y = batch
        return StepOutput(loss=nn.functional.mse_loss(model(x), y), num_samples=y.shape[0])

    return ModelSpec(module=module, step=step)


def build_data(params: dict, seed: int) -> DataSplits:
    """Protocol data factory: random inputs of ``width`` and targets, ``train`` samples."""
    generator = torch.Generator().manual_seed(seed)
    width, train = int(params["width"]), int(params["train"])

    def split(n: int) -> TensorDataset:
        x = torch.randn(n, width, generator=generator)
        return TensorDataset(x, x[:, :1].tanh())

    return DataSplits(train=split(train), val=split(GLOBAL_BATCH), info={"width": width})


def config(name: str, ctx: Context, background: bool | None, workers: int) -> dict[str, Any]:
    quick = ctx.settings.quick
    width, steps = (QUICK_WIDTH, QUICK_STEPS) if quick else (WIDTH, STEPS)
    return {
        "experiment": {"name": name, "output_dir": str(ctx.runs_dir), "seed": 0},
        "model": {"target": "benchmarks.checkpoint_stall:build_model"},
        "data": {
            "target": "benchmarks.checkpoint_stall:build_data",
            "params": {"width": width, "train": steps * GLOBAL_BATCH},
        },
        "train": {
            "epochs": 1,
            "global_batch_size": GLOBAL_BATCH,
            "lr": 1.0e-4,
            "checkpoint_every_steps": None if background is None else EVERY,
            "async_checkpoints": bool(background),
            "keep_checkpoints": None,  # every checkpoint's meta.json is read
        },
        "scaling": {"num_workers": workers, "use_gpu": False},
        "dataloader": {"num_workers": 0},
        "tracking": {"tensorboard": False, "loss_plot": False},
        "fault_tolerance": {"max_failures": 0},
    }


def one_run(ctx: Context, variant: str, round_index: int) -> dict[str, Any]:
    """Train one epoch; its training time and how each checkpoint was taken."""
    ctx.local_ray.ensure()
    name = unique_name("ckpt-stall", variant, round_index)
    result = raytrain_app.train(config(name, ctx, *VARIANTS[variant]), progress=False)
    [row] = read_metrics(result.run_dir)
    taken = []
    for directory in reversed(ckpt.checkpoints_newest_first(result.run_dir / "checkpoints")):
        meta = ckpt.read_meta(directory)
        manifest = (directory / ckpt.MANIFEST_FILE).read_text()
        taken.append({"step": meta["step"], **meta["saving"], "bytes": _bytes(manifest)})
    shutil.rmtree(result.run_dir)  # about 1.2 GB a checkpoint
    return {"epoch_time_s": row["epoch_time_s"], "steps": row["step"], "checkpoints": taken}


def _bytes(manifest: str) -> int:
    return sum(f["size"] for f in json.loads(manifest)["files"].values())


def lost_steps(run: dict[str, Any], baseline: dict[str, Any]) -> float:
    """Steps of training time lost per mid-epoch checkpoint of ``run`` against ``baseline``."""
    mid = [c for c in run["checkpoints"] if c["step"] < run["steps"]]
    end_wait = run["checkpoints"][-1]["waited_s"] - baseline["checkpoints"][-1]["waited_s"]
    lost = run["epoch_time_s"] - baseline["epoch_time_s"] + end_wait
    return lost / len(mid) / (baseline["epoch_time_s"] / baseline["steps"])


def rounds(ctx: Context) -> dict[str, list[dict[str, Any]]]:
    """Every variant once a round, ``repeats`` rounds, in the reverse order every other
    round (A B C, C B A: a drift of the machine's speed favours none), each run with the
    share of the CPUs other work took meanwhile. Unlike ``common.interleave`` a disturbed
    run is kept, not repeated: a round is some 8 minutes here."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for round_index in range(ctx.settings.repeats):
        wait_until_quiet(QUIET_PERCENT, 300)
        for variant in list(VARIANTS)[:: -1 if round_index % 2 else 1]:
            before = CpuWatch.get().mark()
            result = one_run(ctx, variant, round_index)
            result["foreign_cpu_percent"] = round(foreign_percent(before, CpuWatch.get().mark()))
            logger.info("  round %d, %s: %s", round_index + 1, variant, _brief(result))
            runs[variant].append(result)
    return runs


def _brief(result: dict[str, Any]) -> str:
    waits = [round(c["waited_s"] + c["snapshot_s"], 2) for c in result["checkpoints"]]
    return (
        f"epoch {result['epoch_time_s']:.1f} s, checkpoints blocked {waits} s, "
        f"other work {result['foreign_cpu_percent']} % CPU"
    )


def run(ctx: Context) -> dict[str, Any]:
    runs = rounds(ctx)
    baselines = {"sync": "none", "async": "none", "async-spare": "none-spare"}
    lost = {
        v: [lost_steps(r, b) for r, b in zip(runs[v], runs[base], strict=True)]
        for v, base in baselines.items()
    }
    figure = median(lost["async"])
    step_s = median([r["epoch_time_s"] / r["steps"] for r in runs["none"]])
    blocked = [
        c["waited_s"] + c["snapshot_s"]
        for r in runs["async"]
        for c in r["checkpoints"][:-1]  # the mid-epoch ones
    ]
    size = runs["async"][0]["checkpoints"][0]["bytes"]
    return {
        "what": (
            f"steps of training lost per checkpoint, one every {EVERY} steps, 2 CPU workers, "
            f"{size / 1e9:.2f} GB a checkpoint: saved in the background vs no mid-epoch "
            f"checkpoint, over the baseline's step time"
        ),
        "figure": round(figure, 3),
        "goal": f"<= {GOAL} step",
        "goal_met": figure <= GOAL,
        "secondary": (
            f"{median(lost['sync']):.2f} steps on the step's path; step {step_s:.2f} s, "
            f"background snapshot + wait {median(blocked):.2f} s; one worker with a core to "
            f"spare: {median(lost['async-spare']):.2f} steps"
        ),
        "lost_steps_per_checkpoint": {k: [round(x, 3) for x in v] for k, v in lost.items()},
        "step_s": round(step_s, 3),
        "checkpoint_bytes": size,
        "raw": runs,
    }
