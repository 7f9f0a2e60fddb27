"""Scaling curve: raytrain samples/s for 1, 2, 4, ... workers (one CPU each, as many as the
machine has) on the same global batch, and per-worker efficiency against 1 worker.

efficiency(n) = samples/s with n workers / (n x samples/s with 1 worker). No goal: on a
2-core machine the Ray processes share the cores with the workers.
"""

from __future__ import annotations

from typing import Any

from benchmarks import training_rounds
from benchmarks.common import median
from benchmarks.context import Context
from benchmarks.workload import GLOBAL_BATCH


def run(ctx: Context) -> dict[str, Any]:
    runs = training_rounds.results(ctx, "scaling")
    counts = training_rounds.scaling_workers()
    names = dict(zip(counts, runs, strict=True))
    throughput = {n: median([r["samples_per_s"] for r in runs[names[n]]]) for n in counts}
    base = throughput[1]
    curve = [
        {
            "workers": n,
            "samples_per_s": round(throughput[n], 1),
            "speedup": round(throughput[n] / base, 3),
            "efficiency": round(throughput[n] / (n * base), 3),
        }
        for n in counts
    ]
    top = curve[-1]
    return {
        "what": (
            f"raytrain samples/s over epochs 2..{training_rounds.epochs(ctx)}, global batch "
            f"{GLOBAL_BATCH}, 1 CPU per worker; efficiency = samples/s / (workers x 1-worker "
            f"samples/s)"
        ),
        "figure": top["efficiency"],
        "ratio": top["speedup"],
        "ratio_is": f"samples/s with {top['workers']} workers / with 1",
        "secondary": ", ".join(f"{c['workers']}w {c['samples_per_s']:.0f}/s" for c in curve),
        "goal": None,
        "goal_met": None,
        "curve": curve,
        "runs_note": training_rounds.shared_note(ctx),
        "raw": {name: [r["samples_per_s"] for r in runs[name]] for name in runs},
    }
