"""``train()``: config → plan → TorchTrainer → run directory, on the driver.

It connects to (or starts) Ray, makes the plan, checks the workload once on the driver so
bad input fails fast with exit code 2, then runs a ``TorchTrainer`` whose workers execute
``worker.loop.train_worker``, and finally writes ``summary.json``.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.train

from raytrain_app.checkpoint.ranking import best_checkpoint, check_monitor_on_one_batch
from raytrain_app.config import RaytrainConfig, config_to_dict
from raytrain_app.data.stream_order import stream_steps_per_epoch
from raytrain_app.data.stream_windows import StreamSplits
from raytrain_app.driver.failures import user_facing_error
from raytrain_app.driver.local_run import local_processes_config, run_local, torchrun_rank
from raytrain_app.driver.ray_connection import ray_session
from raytrain_app.driver.ray_datasets import RayDataInputs, load_data_splits
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.driver.run_lease import check_lease_held, hold_run_lease, refuse_if_held
from raytrain_app.driver.shared_storage import check_shared
from raytrain_app.driver.trainer import run_trainer
from raytrain_app.errors import BadInputError, RunStoppedError, first_line
from raytrain_app.planning.batch import steps_per_epoch
from raytrain_app.planning.environment import (
    Environment,
    apply_ray_train_defaults,
    detect_environment,
    storage_env_vars,
)
from raytrain_app.planning.recipe import check_schedule_length
from raytrain_app.planning.rules import TrainingPlan, make_plan, resolve_config
from raytrain_app.storage import StorageLocation, is_uri
from raytrain_app.tracking.loss_plot import LOSS_PLOT_FILE, write_loss_plot
from raytrain_app.tracking.metrics_log import METRICS_FILE, read_metrics_text
from raytrain_app.tracking.trackers import check_tracking_installed
from raytrain_app.worker.loop import WorkerTask
from raytrain_app.worker.recipe import check_hook_alone
from raytrain_app.workloads import (
    FactoryRef,
    build_model,
    check_sources,
    model_factory,
    prepare_data,
    resolve_streaming,
)

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What ``train`` returns: where the run lives and how it ended.

    Paths are local ``Path``s, or URI strings for a run directory in an object store.
    """

    run_dir: Path | str
    summary: dict[str, Any]
    metrics: list[dict[str, float]] = field(default_factory=list)

    @property
    def checkpoint(self) -> Path | str:
        """The newest checkpoint (what a resume continues from)."""
        return _path_or_uri(self.summary["checkpoint"])

    @property
    def best_checkpoint(self) -> Path | str | None:
        """The best checkpoint by train.monitor / train.mode (what inference should use)."""
        best = self.summary.get("best_checkpoint")
        return _path_or_uri(best) if best else None


def _path_or_uri(text: str) -> Path | str:
    return text if is_uri(text) else Path(text)


def preflight(
    cfg: RaytrainConfig, run_dir: RunDirectory, plan: TrainingPlan, local: bool = False
) -> tuple[FactoryRef, RayDataInputs | None]:
    """Prepare the data and build data and model once on the driver.

    Catches a broken workload (bad params, failing import, too little data) before any
    worker starts, as a one-line BadInputError instead of retried worker failures. A data
    factory's Ray Datasets are readied here for Ray Train (``driver.ray_datasets``).
    """
    data_ref = prepare_data(
        cfg.data, run_dir.at("data"), cfg.experiment.seed, task_env=storage_env_vars()
    )
    command = "local" if local else "train"
    loaded = _checked(
        "data", load_data_splits, data_ref, cfg.experiment.seed, plan.effective_batch_size, command
    )
    ray_inputs = loaded if isinstance(loaded, RayDataInputs) else None
    splits = ray_inputs.plan.splits() if ray_inputs else loaded
    spec = _checked("model", build_model, model_factory(cfg.model), dict(splits.info))
    if plan.gradient_checkpointing and not callable(
        getattr(spec.module, "gradient_checkpointing_enable", None)
    ):
        raise BadInputError(
            f"optimizations.gradient_checkpointing is true but {type(spec.module).__name__} has "
            f"no gradient_checkpointing_enable() method; add one (see raytrain_app/protocol.py) "
            f"or set optimizations.gradient_checkpointing=false"
        )
    check_hook_alone(spec, cfg.train)
    steps = None
    if isinstance(splits, StreamSplits):  # the manifest tells the sizes; read two windows
        check_monitor_on_one_batch(cfg.train.monitor, spec, splits.preview("val", 2))
        steps = stream_steps_per_epoch(splits.manifest, plan)
    else:
        check_monitor_on_one_batch(cfg.train.monitor, spec, splits.val, splits.collate)
        if not ray_inputs:  # Ray Datasets were counted when readied
            steps = steps_per_epoch(len(splits.train), plan.effective_batch_size)
    if steps:  # a milestone in steps past the end is known once the data is
        check_schedule_length(cfg.train.schedule, steps * cfg.train.epochs, steps)
    return data_ref, ray_inputs


def _resolved(cfg: RaytrainConfig, plan: TrainingPlan) -> RaytrainConfig:
    """``cfg`` with the plan's choices and whether the data streams: a resume must not
    switch between streaming and loading the data (their orders differ)."""
    return resolve_streaming(resolve_config(cfg, plan))


def _checked(section: str, factory: Any, *args: Any) -> Any:
    """Call a workload factory; its ValueError/TypeError becomes a one-line bad-input error."""
    try:
        return factory(*args)
    except BadInputError:
        raise
    except (ValueError, TypeError, KeyError, FileNotFoundError) as exc:
        raise BadInputError(
            f"{section}: {first_line(exc)}; fix the {section} section of the config"
        ) from exc


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
        "checkpoint": _checkpoint_uri(checkpoints, result.checkpoint),
        "worker_nodes": returned.get("worker_nodes", []),
    }


def _checkpoint_uri(checkpoints: StorageLocation, checkpoint: Any) -> str | None:
    """Where Ray put ``checkpoint`` (a path in the storage filesystem), as users name it."""
    if checkpoint is None:
        return None
    return checkpoint.path if checkpoints.is_local else checkpoints.at(checkpoint.path).uri


def _best_summary(run_dir: RunDirectory, cfg: RaytrainConfig) -> dict[str, Any]:
    """``best_checkpoint`` and its monitored value (``best_metric``) for summary.json."""
    best = best_checkpoint(run_dir.at("checkpoints"), cfg.train.monitor, cfg.train.mode)
    return {
        "best_checkpoint": str(best.path) if best else None,
        "best_metric": best.to_summary() if best else None,
    }


def train(
    cfg: RaytrainConfig,
    *,
    address: str | None = None,
    progress: bool = True,
    local: bool = False,
) -> TrainResult | None:
    """Train ``cfg`` with DDP on Ray; resumes the run of the same name and config if any.

    ``local``: in Ray Train's local mode, in this process (``driver.local_run``); under
    torchrun, in each of its processes, of which only rank 0 returns a result (the others
    return None).

    Raises:
        BadInputError: the config, data or model is invalid (nothing was written).
        RunFailedError: the run started and failed.
    """
    start = time.perf_counter()
    if local and address:
        raise BadInputError("local=True runs without a Ray cluster; pass no address")
    if local:
        cfg = local_processes_config(cfg)
        if torchrun_rank():  # torchrun's other processes: rank 0 checks, prepares, records
            run_local(None, cfg, RunDirectory.for_config(cfg).at("checkpoints"))
            return None
    check_tracking_installed(cfg)
    check_sources(cfg.model, cfg.data)  # a wrong target or data path fails before Ray starts
    env = detect_environment()
    if not (local or address or env.ray_address or ray.is_initialized()):
        # Ray will run on this machine: plan against it first, so bad input fails in a
        # second instead of after Ray's start-up.
        local_plan = make_plan(cfg, env)
        RunDirectory.for_config(cfg).check_resumable(_resolved(cfg, local_plan))
    # A run directory another run is writing: exit 2 now, before Ray starts (the directory
    # depends on the name and output_dir alone; nothing is written to look).
    refuse_if_held(RunDirectory.for_config(cfg).location.uri, "train")
    apply_ray_train_defaults()
    with contextlib.nullcontext(env) if local else ray_session(address, env) as cluster_env:
        plan = make_plan(cfg, cluster_env)
        resolved = _resolved(cfg, plan)
        run_dir = RunDirectory.for_config(resolved)
        # An object store is the same store on every node; local mode runs on this one.
        if run_dir.location.is_local and not local:
            check_shared(run_dir.location.local_path.parent, resolved.experiment.output_dir)
        run_dir.check_resumable(resolved)
        # One writer at a time; a second train or tune of this directory exits 2 here. A
        # run that loses the lease stops its workers and exits 1 without writing more.
        with hold_run_lease(run_dir.location.uri, "train"):
            # Again under the lease: of two runs that both passed it, only one gets here.
            resuming = run_dir.check_resumable(resolved)
            result, stop_signal = _run(
                resolved, run_dir, plan, resuming, cluster_env, progress, local
            )
            check_lease_held()  # no summary from a run that lost its directory meanwhile
            summary = _summary(result, plan, time.perf_counter() - start, run_dir.at("checkpoints"))
            summary.update(_best_summary(run_dir, resolved))
            run_dir.write_summary(summary)
            metrics = _read_metrics(run_dir)
            if resolved.tracking.loss_plot:
                _write_loss_plot(run_dir, metrics)
    if summary["status"] == "stopped":
        raise RunStoppedError(
            f"stopped on request ({stop_signal}) after {summary['epochs_completed']} complete "
            f"epoch(s), with a checkpoint at {summary['checkpoint']}; run the same command "
            f"again to resume",
            interrupted=stop_signal == "SIGINT",
        )
    run_path = run_dir.root if run_dir.location.is_local else run_dir.location.uri
    return TrainResult(run_dir=run_path, summary=summary, metrics=metrics)


def _run(
    resolved: RaytrainConfig,
    run_dir: RunDirectory,
    plan: TrainingPlan,
    resuming: bool,
    cluster_env: Environment,
    progress: bool,
    local: bool = False,
) -> tuple[ray.train.Result, str | None]:
    """Check the workload on the driver, write config.yaml, run the TorchTrainer."""
    data_ref, ray_inputs = preflight(resolved, run_dir, plan, local)
    run_dir.write_config(resolved)
    how = " locally (Ray Train's local mode)" if local else ""
    logger.info("%s run%s in %s", "resuming" if resuming else "starting", how, run_dir.location)
    task = WorkerTask(
        config=config_to_dict(resolved),
        plan=plan,
        data=data_ref,
        model=model_factory(resolved.model),
        run_dir=run_dir.location.uri,
        ray_data=ray_inputs.plan if ray_inputs else None,
    )
    if local:
        return run_local(task, resolved, run_dir.at("checkpoints"))
    try:
        return run_trainer(
            task,
            resolved,
            run_dir.at("checkpoints"),
            progress,
            cluster_env.embedded_ray,
            datasets=ray_inputs.datasets if ray_inputs else None,
            dataset_config=ray_inputs.dataset_config if ray_inputs else None,
        )
    except ray.train.TrainingFailedError as exc:
        raise user_facing_error(exc, plan.timeout_s) from exc


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
