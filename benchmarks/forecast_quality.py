"""Forecast quality on real public series: the built-in forecaster's MAE over the best naive
forecast's MAE on the same validation windows. Goal: <= 0.9 on every series.

The series ship inside packages of the ``dev`` extra (statsmodels, vega_datasets), so nothing
is downloaded at run time. Each is written as a Parquet file and trained through
``raytrain_app.train`` with ``data.path``, as a user would bring it; the MAEs are the run's
own last-epoch validation metrics (``summary.json``'s ``final_metrics``): ``val_mae`` for the
model, ``val_persistence_mae`` and ``val_seasonal_naive_mae`` for the naive forecasts.

Run it alone with ``python -m benchmarks.forecast_quality [--repeats N] [--quick]``: it writes
``benchmarks/results/<machine>-<date>-forecast_quality.{json,md}``; ``--scaling global`` trains
the forecaster without per-window scaling, for comparison (``...-forecast_quality-global``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import Settings, unique_name
from benchmarks.context import Context

logger = logging.getLogger(__name__)

GOAL = 0.9
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _sunspots() -> tuple[np.ndarray, np.ndarray]:
    """Yearly mean sunspot number, 1700-2008 (statsmodels)."""
    from statsmodels.datasets import sunspots

    frame = sunspots.load_pandas().data
    return frame["YEAR"].to_numpy(np.int64), frame["SUNACTIVITY"].to_numpy(np.float64)


def _elnino() -> tuple[np.ndarray, np.ndarray]:
    """Monthly sea surface temperature of the El Niño region, 1950-2010 (statsmodels)."""
    from statsmodels.datasets import elnino

    frame = elnino.load_pandas().data
    months = frame.drop(columns="YEAR").to_numpy(np.float64)  # [years, 12]
    years = frame["YEAR"].to_numpy(np.int64)
    index = (years[:, None] * 12 + np.arange(12)).reshape(-1)  # months since year 0
    return index, months.reshape(-1)


def _seattle_wind() -> tuple[np.ndarray, np.ndarray]:
    """Daily mean wind speed in Seattle, 2012-2015 (vega_datasets' seattle-weather)."""
    from vega_datasets import local_data

    frame = local_data.seattle_weather()
    return frame["date"].to_numpy("datetime64[s]"), frame["wind"].to_numpy(np.float64)


@dataclass(frozen=True)
class Series:
    """One real series and how it is windowed and trained.

    Attributes:
        name: short name used in the results.
        what: where it comes from, in words.
        frequency: yearly, monthly or daily.
        load: returns ``(time, value)`` arrays.
        data: ``data.params`` windowing (``season_length`` included).
        epochs: training epochs.
    """

    name: str
    what: str
    frequency: str
    load: Callable[[], tuple[np.ndarray, np.ndarray]]
    data: dict[str, Any] = field(default_factory=dict)
    epochs: int = 30


SERIES = (
    Series(
        "sunspots",
        "yearly sunspot numbers 1700-2008 (statsmodels)",
        "yearly",
        _sunspots,
        {"context_length": 24, "horizon": 4, "val_fraction": 0.25, "season_length": 11},
        epochs=40,
    ),
    Series(
        "elnino",
        "monthly El Niño sea surface temperature 1950-2010 (statsmodels)",
        "monthly",
        _elnino,
        {"context_length": 48, "horizon": 6, "val_fraction": 0.2, "season_length": 12},
        epochs=30,
    ),
    Series(
        "seattle_wind",
        "daily wind speed in Seattle 2012-2015 (vega_datasets seattle-weather)",
        "daily",
        _seattle_wind,
        {"context_length": 28, "horizon": 7, "val_fraction": 0.2, "season_length": 7},
        epochs=20,
    ),
)


def write_parquet(series: Series, directory: Path) -> Path:
    """The series as a Parquet file with columns ``time`` and ``value``."""
    time_values, values = series.load()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{series.name}.parquet"
    pq.write_table(pa.table({"time": time_values, "value": values}), path)
    return path


def train_config(
    series: Series,
    path: Path,
    output_dir: Path,
    *,
    seed: int,
    workers: int = 1,
    epochs: int | None = None,
    model_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A raytrain config dict that trains the built-in forecaster on ``series`` at ``path``."""
    return {
        "experiment": {
            "name": unique_name(series.name, seed),
            "output_dir": str(output_dir),
            "seed": seed,
        },
        "model": {"name": "wind_transformer", "params": dict(model_params or {})},
        "data": {
            "path": str(path),
            "params": {
                "feature_columns": [],
                "target_column": "value",
                "time_column": "time",
                **series.data,
            },
        },
        "train": {"epochs": epochs or series.epochs, "global_batch_size": 32, "lr": 1.0e-3},
        "scaling": {"num_workers": workers, "use_gpu": False},
        "tracking": {"tensorboard": False, "loss_plot": False},
    }


def skill(final_metrics: dict[str, float]) -> dict[str, float]:
    """Model MAE, the naive forecasts' MAEs and the ratio to the best, from a run's metrics."""
    naive = {
        "persistence": final_metrics["val_persistence_mae"],
        **(
            {"seasonal_naive": final_metrics["val_seasonal_naive_mae"]}
            if "val_seasonal_naive_mae" in final_metrics
            else {}
        ),
    }
    best = min(naive, key=naive.__getitem__)
    return {
        "model_mae": final_metrics["val_mae"],
        **{f"{name}_mae": value for name, value in naive.items()},
        "best_naive": best,
        "ratio": final_metrics["val_mae"] / naive[best],
    }


def _run_series(
    ctx: Context, series: Series, data_dir: Path, model_params: dict[str, Any]
) -> dict[str, Any]:
    import raytrain_app as rt

    path = write_parquet(series, data_dir)
    epochs = max(series.epochs // 4, 2) if ctx.settings.quick else series.epochs
    runs = []
    for seed in range(ctx.settings.repeats):
        cfg = train_config(
            series, path, ctx.runs_dir, seed=seed, epochs=epochs, model_params=model_params
        )
        start = time.perf_counter()
        result = rt.train(cfg, progress=False)
        run = {"seed": seed, **skill(result.summary["final_metrics"])}
        run["train_s"] = round(time.perf_counter() - start, 1)
        logger.info("  %s seed %d: %s", series.name, seed, run)
        runs.append(run)
    ratio = median(r["ratio"] for r in runs)
    return {
        "what": series.what,
        "frequency": series.frequency,
        "data_params": series.data,
        "epochs": epochs,
        "ratio": round(ratio, 4),
        "goal_met": ratio <= GOAL,
        "runs": runs,
    }


def run(ctx: Context, model_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train every series ``ctx.settings.repeats`` times (seeds 0, 1, ...); median ratios.

    ``model_params``: the forecaster's ``model.params`` (default: its defaults).
    """
    model_params = dict(model_params or {})
    ctx.local_ray.ensure()
    data_dir = ctx.settings.scratch("forecast-data")
    per_series = {s.name: _run_series(ctx, s, data_dir, model_params) for s in SERIES}
    worst = max(per_series, key=lambda name: per_series[name]["ratio"])
    return {
        "what": (
            "model MAE / best naive MAE (persistence or seasonal naive) on each real series' "
            "validation tail, median over seeds; the figure is the worst series"
        ),
        "ratio": per_series[worst]["ratio"],
        "goal": f"<= {GOAL}",
        "goal_met": all(r["goal_met"] for r in per_series.values()),
        "secondary": ", ".join(f"{n} {r['ratio']:.2f}" for n, r in per_series.items()),
        "model_params": model_params,
        "series": per_series,
    }


def markdown(record: dict[str, Any], meta: dict[str, Any]) -> str:
    """The per-series table of one result record."""
    lines = [
        f"Machine `{meta['machine']}`, torch {meta['torch']}, ray {meta['ray']}, {meta['date']}; "
        f"median over {meta['repeats']} seed(s){', quick mode' if meta.get('quick') else ''}; "
        f"model.params {record['model_params'] or '(defaults)'}.",
        "",
        "| series | frequency | model MAE | persistence MAE | seasonal-naive MAE | "
        "model / best naive | goal | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, series in record["series"].items():
        runs = series["runs"]

        def mid(key: str, runs: list[dict[str, Any]] = runs) -> str:
            values = [r[key] for r in runs if key in r]
            return f"{median(values):.4g}" if values else "—"

        status = "met" if series["goal_met"] else "**missed**"
        lines.append(
            f"| {name} | {series['frequency']} | {mid('model_mae')} | {mid('persistence_mae')} | "
            f"{mid('seasonal_naive_mae')} | {series['ratio']:.3f} | <= {GOAL} | {status} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import environment
    from raytrain_app.testing.isolation import private_home

    parser = argparse.ArgumentParser(prog="python -m benchmarks.forecast_quality")
    parser.add_argument("--repeats", type=int, default=3, help="seeds per series (default 3)")
    parser.add_argument("--quick", action="store_true", help="a quarter of the epochs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--scaling", choices=["window", "global"], help="model.params.scaling (default: its own)"
    )
    args = parser.parse_args(argv)
    model_params = {"scaling": args.scaling} if args.scaling else {}
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    work_dir = Path(tempfile.mkdtemp(prefix="raytrain-bench-"))
    settings = Settings(repeats=args.repeats, quick=args.quick, work_dir=work_dir)
    meta = {
        **environment(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "repeats": args.repeats,
        "quick": args.quick,
        "benchmarks": ["forecast_quality"],
    }
    start = time.perf_counter()
    with private_home(work_dir / "home"):
        ctx = Context(settings, selected=["forecast_quality"])
        try:
            record = run(ctx, model_params)
        finally:
            ctx.local_ray.shutdown()
            shutil.rmtree(work_dir, ignore_errors=True)
    meta["total_runtime_s"] = round(time.perf_counter() - start, 1)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['machine']}-{datetime.date.today().isoformat()}-forecast_quality"
    if args.scaling:
        stem += f"-{args.scaling}"
    payload = {"meta": meta, "forecast_quality": record}
    (args.results_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    table = markdown(record, meta)
    (args.results_dir / f"{stem}.md").write_text(table + "\n")
    print(table)
    return 0 if record["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
