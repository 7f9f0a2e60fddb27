"""The benchmarked workload: the quickstart's wind forecaster and data, built with raytrain's
own factories, so the plain-PyTorch baselines train exactly what raytrain trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_app.config import config_from_dict
from raytrain_app.planning.batch import lr_factor
from raytrain_app.protocol import DataSplits, ModelSpec
from raytrain_app.tracking.metrics_log import read_metrics
from raytrain_app.workloads import FactoryRef, build_data, build_model, model_factory, prepare_data

SEED = 0
GLOBAL_BATCH = 64
LR = 1.0e-3
WEIGHT_DECAY = 0.01  # the schema's default, which raytrain's AdamW uses
GRAD_CLIP = 1.0


def data_params(quick: bool) -> dict[str, Any]:
    """The quickstart's synthetic wind data (stride 4: 217 steps of 64 per epoch); quick: 8."""
    return {"stride": 8 if quick else 4}


def train_config(
    name: str,
    output_dir: Path,
    *,
    workers: int,
    epochs: int,
    data: dict[str, Any],
    model: dict[str, Any] | None = None,
    precision: str = "auto",
    use_gpu: bool = False,
) -> dict[str, Any]:
    """A raytrain config dict for one benchmark run (a fresh ``name`` every time).

    CPU unless ``use_gpu``: the CPU benchmarks compare against CPU baselines even on a
    machine with GPUs.
    """
    return {
        "experiment": {"name": name, "output_dir": str(output_dir), "seed": SEED},
        "model": model or {"name": "wind_transformer"},
        "data": {"name": "synthetic_wind", "params": dict(data)},
        "train": {"epochs": epochs, "global_batch_size": GLOBAL_BATCH, "lr": LR},
        "scaling": {"num_workers": workers, "use_gpu": use_gpu},
        "precision": precision,
    }


@dataclass
class Workload:
    """Data and model factories of a config, the data materialised once in ``data_dir``."""

    data: FactoryRef
    model: FactoryRef

    @classmethod
    def prepare(cls, data: dict[str, Any], data_dir: Path) -> Workload:
        cfg = config_from_dict(train_config("bench", data_dir, workers=1, epochs=1, data=data))
        return cls(data=prepare_data(cfg.data, data_dir, SEED), model=model_factory(cfg.model))

    def build(self) -> tuple[DataSplits, ModelSpec]:
        """Data, then the model with raytrain's seeding (identical initial weights)."""
        import torch

        splits = build_data(self.data, SEED)
        torch.manual_seed(SEED)
        return splits, build_model(self.model, dict(splits.info))


def lr_lambda(total_steps: int):
    """raytrain's schedule with its defaults (no warmup, cosine to 0), for LambdaLR."""
    return lambda step: lr_factor(step, 0, total_steps, 0.0)


def epoch_rows(run_dir: Path) -> list[dict[str, float]]:
    """``metrics.csv`` rows with ``steps`` (optimizer steps of that epoch) added."""
    rows = read_metrics(run_dir)
    previous = 0
    for row in rows:
        row["steps"] = row["step"] - previous
        previous = row["step"]
    return rows


def steady_rows(run_dir: Path) -> list[dict[str, float]]:
    """The epochs after the first (warm-up) of a run."""
    rows = epoch_rows(run_dir)
    if len(rows) < 2:
        raise RuntimeError(f"{run_dir} has {len(rows)} epoch(s); need 2+ to drop the warm-up")
    return rows[1:]


def step_time(rows: list[dict[str, float]]) -> float:
    """Seconds per optimizer step over ``rows``."""
    return sum(r["epoch_time_s"] for r in rows) / sum(r["steps"] for r in rows)


def epoch_time(rows: list[dict[str, float]]) -> float:
    """Mean training time of one epoch over ``rows``."""
    return sum(r["epoch_time_s"] for r in rows) / len(rows)


def samples_per_s(rows: list[dict[str, float]]) -> float:
    return sum(r["steps"] * GLOBAL_BATCH for r in rows) / sum(r["epoch_time_s"] for r in rows)
