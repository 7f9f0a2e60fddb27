"""What a sweep leaves: ``trials.csv`` (one row per trial) and ``best_config.yaml``.

The best trial becomes a complete train config that keeps the trial's global batch and lr
whatever the number of workers it is later trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from raytrain_app.config import RaytrainConfig, config_with_values, dump_config_yaml
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.driver.run_lease import check_lease_held
from raytrain_app.errors import RunFailedError
from raytrain_app.sweep.search_space import trial_config
from raytrain_app.worker.early_stopping import EarlyStopping

TRIALS_FILE = "trials.csv"
BEST_CONFIG_FILE = "best_config.yaml"


@dataclass
class TuneResult:
    """What ``tune`` returns: the trials table and the best trial as a train config.

    Paths are local ``Path``s, or URI strings for a run directory in an object store.
    """

    run_dir: Path | str
    trials: pd.DataFrame
    best_config: RaytrainConfig
    best_config_path: Path | str
    best_metrics: dict[str, Any]


def record_sweep(
    cfg: RaytrainConfig, run_dir: RunDirectory, grid: Any, keys: list[str], interrupted: bool
) -> TuneResult:
    """Write ``trials.csv`` and, unless every trial failed, ``best_config.yaml``.

    Raises:
        KeyboardInterrupt: Ctrl-C ended the sweep (its trials.csv is written).
        RunFailedError: no trial reported a finite ``tune.metric``.
    """
    trials = pd.DataFrame([trial_row(r, keys, cfg, interrupted) for r in grid])
    trials_file = run_dir.at(TRIALS_FILE)
    check_lease_held()  # a sweep whose directory another run took over writes no results
    trials_file.write_text(trials.to_csv(index=False))
    if interrupted:
        raise KeyboardInterrupt
    metric = cfg.tune.metric
    finite = [
        r
        for r in grid
        if r.error is None and r.metrics and math.isfinite(r.metrics.get(metric, math.nan))
    ]
    if not finite:
        raise RunFailedError(
            f"all {len(grid)} trials failed or reported no {metric}; see "
            f"{trials_file} for each trial's error"
        )
    best = grid.get_best_result(
        metric=metric, mode=cfg.tune.mode, scope="last", filter_nan_and_inf=True
    )
    best_cfg = best_config(cfg, {k: best.config[k] for k in keys})
    best_file = run_dir.at(BEST_CONFIG_FILE)
    best_file.write_text(dump_config_yaml(best_cfg))
    local = run_dir.location.is_local
    return TuneResult(
        run_dir=run_dir.root if local else run_dir.location.uri,
        trials=trials,
        best_config=best_cfg,
        best_config_path=best_file.local_path if local else best_file.uri,
        best_metrics=dict(best.metrics),
    )


def trial_row(
    result: Any, keys: list[str], cfg: RaytrainConfig, interrupted: bool
) -> dict[str, Any]:
    metric, history = cfg.tune.metric, result.metrics_dataframe
    values = history[metric].dropna() if history is not None and metric in history else None
    # The last epoch reported, not the rows: a trial resumed after its sweep was killed
    # has its earlier epochs in its checkpoint, and Tune's history may start at the resume.
    if history is None or not len(history):
        epochs = 0
    elif "epoch" in history:
        epochs = int(history["epoch"].max())
    else:
        epochs = len(history)
    best = None
    if values is not None and len(values):
        best = float(values.min() if cfg.tune.mode == "min" else values.max())
    if result.error is not None:
        status = "error"
    elif epochs >= cfg.train.epochs or stopped_by_rule(cfg, history, epochs):
        status = "completed"  # ran its epochs, or until its train.early_stopping rule
    else:
        # After an interruption a short trial may simply not have run to its end yet.
        status = "unfinished" if interrupted else "stopped_early"
    final = (result.metrics or {}).get(metric)
    return {
        # Tune's short id ("76d8c_00000"), also the trial's folder under trials/.
        "trial_id": "_".join(Path(result.path).name.split("_")[2:4]),
        **{key: (result.config or {}).get(key) for key in keys},
        f"final_{metric}": final,
        f"best_{metric}": best,
        "epochs": epochs,
        "status": status,
        "error": str(result.error).strip().splitlines()[-1] if result.error else "",
    }


def stopped_by_rule(cfg: RaytrainConfig, history: Any, epochs: int) -> bool:
    """Whether the trial's own early-stopping rule ended it after ``epochs`` (not ASHA)."""
    if cfg.train.early_stopping is None or history is None or not len(history):
        return False
    return EarlyStopping.of(cfg.train).stopped_at(history.to_dict("records")) == epochs


def best_config(cfg: RaytrainConfig, sampled: dict[str, Any]) -> RaytrainConfig:
    """The winner as a complete train config; its global batch and lr carry over as is."""
    best = trial_config(cfg, sampled)
    extra: dict[str, Any] = {"experiment.name": f"{cfg.experiment.name}-best"}
    if best.train.lr_scaling != "none" and best.train.base_batch_size is None:
        # Pin the batch the lr was tuned at, so a scaling rule scales from the right place.
        extra["train.base_batch_size"] = best.train.global_batch_size
    if best.scaling.gpus_per_worker < 1:
        # Trials shared GPUs; DDP workers cannot (NCCL refuses two ranks on one GPU).
        extra["scaling.gpus_per_worker"] = 1.0
    return config_with_values(best, extra)
