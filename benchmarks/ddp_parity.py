"""DDP parity: 2-worker epoch time on gloo, raytrain vs the same training as a plain DDP
script launched by torchrun (``torchrun_ddp.py``). Goal: <= 1.05.

The breakdown splits the ratio at raytrain's own loop run by torchrun without Ray
(``torchrun_loop.py``): Ray's runtime = raytrain / loop-on-torchrun, raytrain's loop =
loop-on-torchrun / plain script. Both come from the same interleaved rounds.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from benchmarks import training_rounds
from benchmarks.common import ratio_record
from benchmarks.context import Context
from benchmarks.workload import GLOBAL_BATCH

GOAL = 1.05


def run(ctx: Context) -> dict[str, Any]:
    runs = training_rounds.results(ctx, "ddp_parity")
    n_epochs = training_rounds.epochs(ctx)
    epoch_s = {k: [r["steady_epoch_s"] for r in v] for k, v in runs.items()}
    loop = median(epoch_s["raytrain_loop_torchrun_2_procs"])
    breakdown = {
        "ray_runtime": round(median(epoch_s["raytrain_2_workers"]) / loop, 4),
        "raytrain_loop": round(loop / median(epoch_s["torchrun_2_procs"]), 4),
        "note": (
            "ray_runtime = raytrain on Ray / raytrain's loop on torchrun; raytrain_loop = "
            "raytrain's loop on torchrun / the plain DDP script; their product is the ratio"
        ),
    }
    return ratio_record(
        candidate="raytrain_2_workers",
        baseline="torchrun_2_procs",
        samples=epoch_s,
        goal=GOAL,
        unit="s per epoch",
        what=(
            f"2-worker DDP training time per epoch on gloo (epochs 2..{n_epochs}), global "
            f"batch {GLOBAL_BATCH} = 2 x {GLOBAL_BATCH // 2}, 1 intra-op thread per process"
        ),
        breakdown=breakdown,
        runs=runs,
        runs_note=training_rounds.shared_note(ctx),
    )
