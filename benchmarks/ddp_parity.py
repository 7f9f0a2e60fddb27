"""DDP parity: 2-worker epoch time on gloo, raytrain vs the same training as a plain DDP
script launched by torchrun (``torchrun_ddp.py``). Goal: <= 1.05.
"""

from __future__ import annotations

from typing import Any

from benchmarks import training_rounds
from benchmarks.common import ratio_record
from benchmarks.context import Context
from benchmarks.workload import GLOBAL_BATCH

GOAL = 1.05


def run(ctx: Context) -> dict[str, Any]:
    runs = training_rounds.results(ctx, "ddp_parity")
    n_epochs = training_rounds.epochs(ctx)
    return ratio_record(
        candidate="raytrain_2_workers",
        baseline="torchrun_2_procs",
        samples={k: [r["steady_epoch_s"] for r in v] for k, v in runs.items()},
        goal=GOAL,
        unit="s per epoch",
        what=(
            f"2-worker DDP training time per epoch on gloo (epochs 2..{n_epochs}), global "
            f"batch {GLOBAL_BATCH} = 2 x {GLOBAL_BATCH // 2}, 1 intra-op thread per process"
        ),
        runs=runs,
        runs_note=training_rounds.shared_note(ctx),
    )
