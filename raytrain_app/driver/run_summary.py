"""What a finished run leaves besides its checkpoints: ``summary.json`` and ``loss.png``.

Written by the driver alone, under the run's lease, from what the workers returned and
what rank 0 wrote (``metrics.csv``, the checkpoints Ray kept).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train

from raytrain_app.checkpoint.ranking import best_checkpoint
from raytrain_app.driver.checkpoint_sweep import remove_unrecorded_checkpoints
from raytrain_app.driver.goodput import attempts_of, run_goodput
from raytrain_app.driver.launch import Launch
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.driver.run_lease import check_lease_held
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.storage import StorageLocation
from raytrain_app.tracking.loss_plot import LOSS_PLOT_FILE, write_loss_plot
from raytrain_app.tracking.metrics_log import METRICS_FILE, read_metrics_text


def record_run(
    launch: Launch, result: ray.train.Result, wall_s: float
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Write ``summary.json`` (and ``loss.png`` if asked); the summary and metrics rows."""
    check_lease_held()  # no summary from a run that lost its directory meanwhile
    run_dir, resolved = launch.run_dir, launch.resolved
    summary = _summary(result, launch.plan, wall_s, run_dir.at("checkpoints"))
    summary["goodput"] = _goodput(result, wall_s)
    train = resolved.train
    remove_unrecorded_checkpoints(
        run_dir.at("checkpoints"), result, train.keep_checkpoints, train.monitor, train.mode
    )
    summary.update(_best_summary(run_dir, train.monitor, train.mode))
    run_dir.write_summary(summary)
    metrics = _read_metrics(run_dir)
    if resolved.tracking.loss_plot:
        _write_loss_plot(run_dir, metrics)
    return summary, metrics


def _summary(
    result: ray.train.Result, plan: TrainingPlan, wall: float, checkpoints: StorageLocation
) -> dict[str, Any]:
    returned = result.return_value or {}
    history = returned.get("history", [])
    total_samples = sum(row["samples_per_s"] * row["epoch_time_s"] for row in history)
    train_time = sum(row["epoch_time_s"] for row in history)
    return {
        "status": "stopped" if returned.get("stopped") else "completed",
        "final_metrics": history[-1] if history else {},
        "epochs_completed": len(history),
        **(
            {"stopped_early_at_epoch": returned["stopped_early_at_epoch"]}
            if returned.get("stopped_early_at_epoch")
            else {}
        ),
        # The size the run ended with, and the [first step, size] of each stretch trained
        # at one size (several when an elastic run resized or a resume changed the size).
        "world_size": returned.get("world_size", plan.world_size),
        "world_size_segments": [
            {"step": step, "world_size": size}
            for step, size in returned.get("world_size_segments", [])
        ],
        **({"worker_range": list(plan.worker_range)} if plan.worker_range else {}),
        # The workers' split: a memory probe (max_batch_per_worker: auto) may change it.
        "per_worker_batch_size": returned.get("per_worker_batch_size", plan.per_worker_batch_size),
        "grad_accum_steps": returned.get("grad_accum_steps", plan.grad_accum_steps),
        "effective_batch_size": plan.effective_batch_size,
        "precision": plan.precision,
        "backend": plan.backend,
        "strategy": plan.strategy,
        "lr": plan.lr,
        "wall_time_s": round(wall, 3),
        "samples_per_s": total_samples / train_time if train_time else 0.0,
        # items/s, FLOP/s per worker and MFU over the run (worker.throughput)
        "throughput": returned.get("throughput", {}),
        "checkpoint": _checkpoint_uri(checkpoints, result.checkpoint),
        "worker_nodes": returned.get("worker_nodes", []),
    }


def _goodput(result: ray.train.Result, wall_s: float) -> dict[str, float]:
    """Where the run's wall time went (``driver.goodput``), ending now."""
    returned = result.return_value or {}
    attempts = attempts_of(returned, returned.get("goodput_attempts", []))
    return run_goodput(wall_s, time.time(), attempts)


def _checkpoint_uri(checkpoints: StorageLocation, checkpoint: Any) -> str | None:
    """Where Ray put ``checkpoint`` (a path in the storage filesystem), as users name it."""
    if checkpoint is None:
        return None
    return checkpoint.path if checkpoints.is_local else checkpoints.at(checkpoint.path).uri


def _best_summary(run_dir: RunDirectory, monitor: str, mode: str) -> dict[str, Any]:
    """``best_checkpoint`` and its monitored value (``best_metric``) for summary.json."""
    best = best_checkpoint(run_dir.at("checkpoints"), monitor, mode)
    return {
        "best_checkpoint": str(best.path) if best else None,
        "best_metric": best.to_summary() if best else None,
    }


def _read_metrics(run_dir: RunDirectory) -> list[dict[str, float]]:
    """The rows of the run's ``metrics.csv``, wherever it lives; [] when absent."""
    metrics = run_dir.at(METRICS_FILE)
    return read_metrics_text(metrics.read_text()) if metrics.is_file() else []


def _write_loss_plot(run_dir: RunDirectory, metrics: list[dict[str, float]]) -> None:
    """Draw ``loss.png`` locally; for a run in an object store, upload it there."""
    if run_dir.location.is_local:
        write_loss_plot(run_dir.root, metrics)
        return
    with tempfile.TemporaryDirectory(prefix="raytrain-plot-") as scratch:
        drawn = write_loss_plot(Path(scratch), metrics)
        if drawn is not None:
            run_dir.at(LOSS_PLOT_FILE).upload(drawn)
