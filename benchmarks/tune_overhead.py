"""Tune overhead: wall time of an 8-trial sweep of fixed-length one-worker trials (FIFO, no
early stopping) on this machine's CPUs vs its theoretical minimum, the trials' own run time
x trials / concurrency. Goal: <= 1.2.

A trial's own run time is Tune's ``time_total_s`` (the trainable from its start to its last
report: data, model, epochs, validation, checkpoints). The ratio against the trials' pure
training time (``metrics.csv`` epoch times) is recorded too. The baseline comes from the
same sweep, so there is nothing to interleave; repeats are whole sweeps.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import raytrain_app
from benchmarks.common import median, unique_name, usable_cpus
from benchmarks.context import Context
from benchmarks.workload import GLOBAL_BATCH, LR, SEED, epoch_rows

logger = logging.getLogger(__name__)

GOAL = 1.2
TRIALS = 8


def sweep_config(name: str, output_dir: Path, quick: bool) -> dict[str, Any]:
    return {
        "experiment": {"name": name, "output_dir": str(output_dir), "seed": SEED},
        "model": {"name": "wind_transformer"},
        # The built-in sweep's data (stride 8); quick: a quarter of it.
        "data": {"name": "synthetic_wind", "params": {"stride": 32 if quick else 8}},
        "train": {"epochs": 2, "global_batch_size": GLOBAL_BATCH, "lr": LR},
        "scaling": {"use_gpu": False},  # one CPU per trial, also on a machine with GPUs
        "tune": {
            "num_samples": TRIALS,
            "scheduler": "fifo",  # every trial runs all its epochs: fixed length
            "search": "random",
            "metric": "val_loss",
            "mode": "min",
            # The lr does not change the work of a step.
            "param_space": {"train.lr": {"loguniform": [3.0e-4, 3.0e-3]}},
        },
    }


def _last_result(result_json: Path) -> dict[str, Any]:
    lines = [line for line in result_json.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])


def trial_times(run_dir: Path) -> list[dict[str, float]]:
    """Per trial: Tune's ``time_total_s``, the summed epoch training time, and when its
    last epoch ended (``metrics.csv`` is appended live by the trial itself)."""
    totals = {
        _last_result(p)["trial_id"]: _last_result(p)["time_total_s"]
        for p in (run_dir / "tune").glob("*/result.json")
    }
    trials = []
    for trial in sorted((run_dir / "trials").iterdir()):
        metrics = trial / "metrics.csv"
        if trial.name in totals and metrics.is_file():
            trials.append(
                {
                    "time_total_s": totals[trial.name],
                    "training_s": sum(r["epoch_time_s"] for r in epoch_rows(trial)),
                    "end": metrics.stat().st_mtime,
                }
            )
    return trials


def where_time_goes(
    trials: list[dict[str, float]], start: float, end: float, concurrency: int
) -> dict[str, float]:
    """Split the sweep's wall time: before the first trial runs, CPU-slots left idle
    between trials (launching the next trial's process), and after the last one ended.

    A trial's start is approximated as its last epoch's end minus its ``time_total_s``.
    """
    starts = [t["end"] - t["time_total_s"] for t in trials]
    first, last = min(starts), max(t["end"] for t in trials)
    busy = sum(t["time_total_s"] for t in trials)
    idle = concurrency * (last - first) - busy
    return {
        "until_first_trial_runs_s": round(first - start, 2),
        "idle_slot_s_between_trials": round(idle, 2),
        "idle_slot_s_per_trial": round(idle / len(trials), 2),
        "after_last_trial_s": round(end - last, 2),
    }


def one_sweep(ctx: Context, round_index: int) -> dict[str, Any]:
    ctx.local_ray.ensure()
    cfg = sweep_config(unique_name("tune", round_index), ctx.runs_dir, ctx.settings.quick)
    start = time.time()
    result = raytrain_app.tune(cfg)
    end = time.time()
    trials = trial_times(result.run_dir)
    if len(trials) != TRIALS:
        raise RuntimeError(
            f"expected {TRIALS} trial results in {result.run_dir}, got {len(trials)}"
        )
    concurrency = usable_cpus()  # one CPU per trial: raytrain's default concurrency here
    minimum = sum(t["time_total_s"] for t in trials) / concurrency
    return {
        "wall_s": end - start,
        "ideal_s": minimum,
        "ratio": (end - start) / minimum,
        "ratio_vs_training_only": (end - start)
        / (sum(t["training_s"] for t in trials) / concurrency),
        "trial_time_total_s": [round(t["time_total_s"], 3) for t in trials],
        "trial_training_s": [round(t["training_s"], 3) for t in trials],
        "concurrency": concurrency,
        "where_time_goes": where_time_goes(trials, start, end, concurrency),
    }


def run(ctx: Context) -> dict[str, Any]:
    sweeps = []
    for round_index in range(ctx.settings.repeats):
        sweep = one_sweep(ctx, round_index)
        logger.info(
            "  round %d/%d: wall %.1f s, ideal %.1f s, ratio %.3f; %s",
            round_index + 1,
            ctx.settings.repeats,
            sweep["wall_s"],
            sweep["ideal_s"],
            sweep["ratio"],
            sweep["where_time_goes"],
        )
        sweeps.append(sweep)
    ratio = median([s["ratio"] for s in sweeps])
    return {
        "what": (
            f"{TRIALS} one-worker trials x 2 epochs, FIFO, on {sweeps[0]['concurrency']} CPUs: "
            f"sweep wall time / (sum of trials' time_total_s / concurrency)"
        ),
        "ratio": round(ratio, 4),
        "goal": f"<= {GOAL}",
        "goal_met": ratio <= GOAL,
        "secondary": (
            f"{median([s['wall_s'] for s in sweeps]):.1f} s wall vs "
            f"{median([s['ideal_s'] for s in sweeps]):.1f} s ideal"
        ),
        "ratio_vs_training_only": round(median([s["ratio_vs_training_only"] for s in sweeps]), 4),
        "raw": sweeps,
    }
