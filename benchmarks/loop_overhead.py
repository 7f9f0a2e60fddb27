"""Loop overhead: steady-state time per optimizer step, raytrain (1 Ray Train worker) vs a
plain PyTorch loop on the same model, data and batch (``plain_loop``). Goal: <= 1.03.

raytrain's per-step time is its metrics.csv ``epoch_time_s`` / steps of that epoch, over
the epochs after the first.
"""

from __future__ import annotations

from typing import Any

from benchmarks import training_rounds
from benchmarks.common import ratio_record
from benchmarks.context import Context
from benchmarks.workload import GLOBAL_BATCH

GOAL = 1.03


def run(ctx: Context) -> dict[str, Any]:
    runs = training_rounds.results(ctx, "loop_overhead")
    n_epochs = training_rounds.epochs(ctx)
    return ratio_record(
        candidate="raytrain_1_worker",
        baseline="plain_pytorch",
        samples={k: [r["s_per_step"] for r in v] for k, v in runs.items()},
        goal=GOAL,
        unit="s per optimizer step",
        what=(
            f"steady-state time per optimizer step (epochs 2..{n_epochs} of {n_epochs}), "
            f"micro-batch {GLOBAL_BATCH}, fp32, 1 intra-op thread"
        ),
        runs=runs,
        runs_note=training_rounds.shared_note(ctx),
    )
