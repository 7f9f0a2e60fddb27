"""Run the benchmark suite: ``python -m benchmarks.run [--only NAME] [--repeats N] [--quick]``.

Writes ``benchmarks/results/<machine>-<date>.json`` (one key per benchmark: its ratio or
figure, the goal and the raw timings) and a markdown table next to it, and prints the table.
A run with ``--only`` adds the benchmark names to the file name.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common import (
    QUIET_PERCENT,
    REPEATED_RUNS,
    REPO_ROOT,
    CpuWatch,
    Settings,
    import_torch_cpu_s,
    machine_name,
    usable_cpus,
    wait_until_quiet,
)
from benchmarks.context import Context
from benchmarks.report import markdown_table
from raytrain_app.testing.isolation import private_home

logger = logging.getLogger("benchmarks.run")

# Benchmark name -> module with ``run(ctx) -> dict``; the order they run in.
BENCHMARKS = {
    "loop_overhead": "benchmarks.loop_overhead",
    "ddp_parity": "benchmarks.ddp_parity",
    "first_step": "benchmarks.first_step",
    "data_wait": "benchmarks.data_wait",
    "streaming": "benchmarks.streaming",
    "tune_overhead": "benchmarks.tune_overhead",
    "scaling": "benchmarks.scaling",
    "checkpoint_stall": "benchmarks.checkpoint_stall",
    "forecast_quality": "benchmarks.forecast_quality",
    "gpu": "benchmarks.gpu",
}
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument(
        "--only",
        action="append",
        choices=list(BENCHMARKS),
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured rounds per benchmark (default 3)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller data and fewer epochs (a smoke run)"
    )
    parser.add_argument(
        "--results-dir", type=Path, default=RESULTS_DIR, help="where to write the results"
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=600.0,
        help="seconds to wait for a quiet machine before each benchmark (default 600)",
    )
    parser.add_argument("--keep-work-dir", action="store_true", help="keep run directories")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def environment() -> dict[str, Any]:
    import ray
    import torch

    return {
        "machine": machine_name(),
        "platform": platform.platform(),
        "cpus": usable_cpus(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "import_torch_cpu_s": import_torch_cpu_s(),
    }


def run_one(name: str, ctx: Context, max_wait_s: float) -> dict[str, Any]:
    logger.info("== %s", name)
    background = wait_until_quiet(QUIET_PERCENT, max_wait_s)
    start = time.perf_counter()
    try:
        record = importlib.import_module(BENCHMARKS[name]).run(ctx)
    except Exception as exc:  # one broken benchmark must not lose the others' results
        logger.error("%s failed: %s", name, exc)
        record = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    record["elapsed_s"] = round(time.perf_counter() - start, 1)
    record["cpu_busy_percent_before"] = round(background, 1)
    logger.info("== %s done in %.0f s", name, record["elapsed_s"])
    return record


def write_results(results: dict[str, Any], meta: dict[str, Any], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['machine']}-{datetime.date.today().isoformat()}"
    if meta["benchmarks"] != list(BENCHMARKS):  # a partial run never replaces the full one
        stem += "-" + "+".join(meta["benchmarks"])
    json_path = directory / f"{stem}.json"
    json_path.write_text(json.dumps({"meta": meta, **results}, indent=2, default=str) + "\n")
    (directory / f"{stem}.md").write_text(markdown_table(results, meta) + "\n")
    return json_path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    # A plain kill still stops this suite's Ray and removes its scratch space.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = args.only or list(BENCHMARKS)
    work_dir = Path(tempfile.mkdtemp(prefix="raytrain-bench-"))
    settings = Settings(repeats=args.repeats, quick=args.quick, work_dir=work_dir)
    meta = {
        **environment(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "repeats": args.repeats,
        "quick": args.quick,
        "benchmarks": names,
    }
    logger.info("machine %s; running %s; work dir %s", meta["machine"], ", ".join(names), work_dir)
    start = time.perf_counter()
    results: dict[str, Any] = {}
    with private_home(work_dir / "home"):
        ctx = Context(settings, selected=names)
        try:
            for name in names:
                results[name] = run_one(name, ctx, args.max_wait)
        finally:
            ctx.local_ray.shutdown()
            CpuWatch.stop()
            if not args.keep_work_dir:
                shutil.rmtree(work_dir, ignore_errors=True)
    meta["total_runtime_s"] = round(time.perf_counter() - start, 1)
    meta["runs_repeated_for_other_work"] = list(REPEATED_RUNS)
    path = write_results(results, meta, args.results_dir)
    print(markdown_table(results, meta))
    logger.info("results in %s (and .md); total %.0f s", path, meta["total_runtime_s"])
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
