"""Configs and checks the GPU tier shares: the shipped configs as users get them, the small
sine regression (``tests/support/workloads/faults.py``) for the runs that only need a
model, and the ``gpu_witness`` wrapper that records what each worker ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

import raytrain_app as rt
from raytrain_app.tracking.metrics_log import TIMING_COLUMNS

SHIPPED = Path(rt.__file__).parent / "configs"

GLOBAL_BATCH = 32
EPOCHS = 3
STEPS_PER_EPOCH = 50  # 1601 train samples / global batch 32


def has_bf16() -> bool:
    """bf16, and with it the defaults of compute capability >= 8.0: compile, TF32."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 0)


def shipped(name: str, output_dir: Path) -> dict[str, Any]:
    """A config of ``raytrain_app/configs`` as a user starts from it, on one GPU, writing
    into ``output_dir``."""
    cfg = yaml.safe_load((SHIPPED / name).read_text())
    cfg["experiment"]["output_dir"] = str(output_dir)
    cfg["scaling"]["num_workers"] = 1
    return cfg


def witnessed(model: dict[str, Any], record_dir: Path, **options: Any) -> dict[str, Any]:
    """The ``model`` section wrapped in ``gpu_witness`` (which records to ``record_dir``)."""
    inner = model.get("target") or model["name"]
    params = {"inner": inner, "inner_params": model.get("params", {}), **options}
    return {
        "target": "gpu_witness:build_model",
        "params": {**params, "record_dir": str(record_dir)},
    }


def sine_config(
    output_dir: Path, name: str, workers: int, params: dict | None = None, **overrides: Any
) -> dict[str, Any]:
    """3 epochs of the sine regression on ``workers`` GPUs, precision and compile left
    ``auto``. ``params`` add to the model's; a dict in ``overrides`` updates that section
    key by key, any other value replaces it."""
    cfg: dict[str, Any] = {
        "experiment": {"name": name, "output_dir": str(output_dir), "seed": 5},
        "model": {"target": "faults:build_model", "params": {"hidden": 64, **(params or {})}},
        "data": {"target": "faults:build_data", "params": {"num_samples": 2002}},
        "train": {"epochs": EPOCHS, "global_batch_size": GLOBAL_BATCH, "lr": 0.01},
        "scaling": {"num_workers": workers, "use_gpu": True},
        "dataloader": {"num_workers": 0},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def assert_learned(result: Any, cfg: dict[str, Any], restarted: bool = False) -> None:
    """Finite weights and a validation loss that went down; unless ``restarted`` (a test
    that kills a worker), no worker group failed and was restarted on the way: Ray's
    restarts would hide a worker's error behind a run that ends well. ``cfg`` (the config
    trained) lets ``load_model`` call its own model factory (a checkpoint's code is not
    trusted)."""
    restart_s = result.summary["goodput"]["restart_s"]
    assert (restart_s > 0) if restarted else (restart_s == 0), result.summary["goodput"]
    losses = [row["val_loss"] for row in result.metrics]
    assert losses[-1] < losses[0], losses
    model = rt.load_model(result.run_dir, config=cfg)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def without_timings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in rows]
