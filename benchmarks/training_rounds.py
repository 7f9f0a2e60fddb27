"""The training runs behind loop_overhead, ddp_parity and scaling, run once per invocation.

Each round runs every needed variant once (raytrain 1 worker, plain PyTorch, raytrain 2
workers, torchrun 2 processes, ...), so every pair a benchmark compares is interleaved
A B A B and shares one set of runs: raytrain's 1- and 2-worker runs serve the overhead,
parity and scaling figures alike. The first epoch of every run is its warm-up.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import raytrain_app
from benchmarks import plain_loop
from benchmarks.common import REPO_ROOT, interleave, unique_name, usable_cpus
from benchmarks.context import Context
from benchmarks.ray_setup import subprocess_env
from benchmarks.workload import (
    GLOBAL_BATCH,
    epoch_rows,
    epoch_time,
    samples_per_s,
    steady_rows,
    step_time,
    train_config,
)
from raytrain_app.config import config_from_dict
from raytrain_app.driver.run_directory import RunDirectory

logger = logging.getLogger(__name__)

TORCHRUN_SCRIPT = REPO_ROOT / "benchmarks" / "torchrun_ddp.py"
TORCHRUN_LOOP_SCRIPT = REPO_ROOT / "benchmarks" / "torchrun_loop.py"


def epochs(ctx: Context) -> int:
    """Epochs per run: the first is the warm-up, the rest are measured."""
    return 2 if ctx.settings.quick else 3


def scaling_workers() -> list[int]:
    """1, 2, 4, ... workers, as many as this machine has CPUs for (one each)."""
    counts, n = [], 1
    while n <= usable_cpus() and GLOBAL_BATCH % n == 0:
        counts.append(n)
        n *= 2
    return counts


def run_config(ctx: Context, prefix: str, workers: int, round_index: int) -> dict[str, Any]:
    """The benchmark's raytrain config for one run, under a fresh experiment name."""
    return train_config(
        unique_name(prefix, workers, round_index),
        ctx.runs_dir,
        workers=workers,
        epochs=epochs(ctx),
        data=ctx.data_params,
    )


def raytrain_run(ctx: Context, workers: int, round_index: int) -> dict[str, Any]:
    """One ``raytrain_app.train`` in this process's Ray; timings from its metrics.csv."""
    ctx.local_ray.ensure()
    cfg = run_config(ctx, "train", workers, round_index)
    result = raytrain_app.train(cfg, progress=False)
    rows = steady_rows(result.run_dir)
    return {
        "s_per_step": step_time(rows),
        "steady_epoch_s": epoch_time(rows),
        "samples_per_s": samples_per_s(rows),
        "epoch_time_s": [round(r["epoch_time_s"], 4) for r in epoch_rows(result.run_dir)],
        "wall_time_s": result.summary["wall_time_s"],
    }


def plain_run(ctx: Context) -> dict[str, Any]:
    """The plain PyTorch loop in this process, 1 intra-op thread."""
    workload = ctx.workload()
    times = plain_loop.train_epochs(workload, epochs(ctx), batch_size=GLOBAL_BATCH)
    splits, _ = workload.build()
    steps = len(splits.train) // GLOBAL_BATCH
    steady = times[1:]
    return {
        "s_per_step": sum(steady) / (steps * len(steady)),
        "steady_epoch_s": sum(steady) / len(steady),
        "epoch_time_s": [round(t, 4) for t in times],
    }


def torchrun_launch(nproc: int, script: Path, *args: str) -> list[str]:
    """``torchrun --standalone`` of ``script`` with ``nproc`` processes on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


def run_torchrun(command: list[str], scratch: Path) -> None:
    """Run a torchrun ``command`` with 1 intra-op thread per process; raise if it fails."""
    env = subprocess_env(scratch / "home", OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, cwd=scratch, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}): {done.stderr[-2000:]}")


def torchrun_command(
    nproc: int, data_dir: Path, data_params: dict, n_epochs: int, out: Path, *extra: str
) -> list[str]:
    return torchrun_launch(
        nproc,
        TORCHRUN_SCRIPT,
        f"--data-dir={data_dir}",
        f"--data-params={json.dumps(data_params)}",
        f"--epochs={n_epochs}",
        f"--global-batch={GLOBAL_BATCH}",
        f"--out={out}",
        *extra,
    )


def torchrun_run(ctx: Context, nproc: int) -> dict[str, Any]:
    """``torchrun_ddp.py`` on the benchmark data; rank 0's epoch times."""
    ctx.workload()  # generates the data the script reads
    scratch = ctx.settings.scratch("torchrun")
    out = scratch / "epochs.json"
    command = torchrun_command(
        nproc, ctx.settings.work_dir / "data", ctx.data_params, epochs(ctx), out
    )
    run_torchrun(command, scratch)
    times = json.loads(out.read_text())["epoch_time_s"]
    steady = times[1:]
    return {
        "steady_epoch_s": sum(steady) / len(steady),
        "epoch_time_s": [round(t, 4) for t in times],
    }


def torchrun_loop_run(ctx: Context, nproc: int, round_index: int) -> dict[str, Any]:
    """raytrain's worker loop on a torchrun process group (``torchrun_loop.py``), no Ray."""
    cfg = run_config(ctx, "torchrun-loop", nproc, round_index)
    scratch = ctx.settings.scratch("torchrun-loop")
    run_torchrun(
        torchrun_launch(nproc, TORCHRUN_LOOP_SCRIPT, f"--config={json.dumps(cfg)}"), scratch
    )
    run_dir = RunDirectory.for_config(config_from_dict(cfg)).root
    return {
        "steady_epoch_s": epoch_time(steady_rows(run_dir)),
        "epoch_time_s": [round(r["epoch_time_s"], 4) for r in epoch_rows(run_dir)],
    }


def variants(ctx: Context) -> dict[str, Callable[[int], dict[str, Any]]]:
    """Every training variant by name, in the order a round runs them."""
    found: dict[str, Callable[[int], dict[str, Any]]] = {
        "raytrain_1_worker": lambda i: raytrain_run(ctx, 1, i),
        "plain_pytorch": lambda i: plain_run(ctx),
        "raytrain_2_workers": lambda i: raytrain_run(ctx, 2, i),
        "torchrun_2_procs": lambda i: torchrun_run(ctx, 2),
        "raytrain_loop_torchrun_2_procs": lambda i: torchrun_loop_run(ctx, 2, i),
    }
    for n in scaling_workers():
        found.setdefault(f"raytrain_{n}_workers", lambda i, n=n: raytrain_run(ctx, n, i))
    return found


def needed(benchmark: str) -> list[str]:
    if benchmark == "loop_overhead":
        return ["raytrain_1_worker", "plain_pytorch"]
    if benchmark == "ddp_parity":
        return ["raytrain_2_workers", "torchrun_2_procs", "raytrain_loop_torchrun_2_procs"]
    if benchmark == "scaling":
        return [
            "raytrain_1_worker" if n == 1 else f"raytrain_{n}_workers" for n in scaling_workers()
        ]
    return []


def results(ctx: Context, benchmark: str) -> dict[str, list[dict[str, Any]]]:
    """The runs ``benchmark`` compares; the rounds run once, for every selected benchmark."""
    if ctx.training_results is None:
        wanted = {name for b in ctx.selected for name in needed(b)} | set(needed(benchmark))
        chosen = {k: v for k, v in variants(ctx).items() if k in wanted}
        logger.info(
            "  training rounds (shared by %s): %s", ", ".join(ctx.selected), ", ".join(chosen)
        )
        ctx.training_results = interleave(chosen, ctx.settings.repeats)
    return {k: ctx.training_results[k] for k in needed(benchmark)}


def shared_note(ctx: Context) -> str:
    """How the runs were shared, for the records of the benchmarks that use them."""
    users = [b for b in ctx.selected if needed(b)]
    return f"training rounds shared by {', '.join(users)} (timed under the first of them)"
