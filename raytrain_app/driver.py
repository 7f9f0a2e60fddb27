"""The driver side of ``raytrain train``: config → plan → TorchTrainer → run directory.

It connects to (or starts) Ray, makes the plan, checks the workload once on the driver so
bad input fails fast with exit code 2, then runs a ``TorchTrainer`` whose workers execute
``loop.train_worker``, and finally writes ``summary.json``.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchConfig

from raytrain_app.config import RaytrainConfig, config_to_dict
from raytrain_app.environment import (
    Environment,
    apply_ray_train_defaults,
    detect_environment,
    ray_cluster_resources,
    training_worker_env_vars,
    unset_ray_train_defaults,
)
from raytrain_app.errors import BadInputError, RunFailedError, RunStoppedError
from raytrain_app.loop import WorkerTask, train_worker
from raytrain_app.metrics_log import read_metrics
from raytrain_app.monitor import SCORE_KEY, best_checkpoint, check_monitor_on_one_batch
from raytrain_app.plan import TrainingPlan, make_plan, resolve_config, steps_per_epoch
from raytrain_app.progress import DriverProgress
from raytrain_app.ray_trainer import RaytrainTorchTrainer
from raytrain_app.reachability import check_reachable
from raytrain_app.run_directory import RunDirectory
from raytrain_app.tracking import check_tracking_installed, write_loss_plot
from raytrain_app.workloads import FactoryRef, build_data, build_model, model_factory, prepare_data

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What ``train`` returns: where the run lives and how it ended."""

    run_dir: Path
    summary: dict[str, Any]
    metrics: list[dict[str, float]] = field(default_factory=list)

    @property
    def checkpoint(self) -> Path:
        """The newest checkpoint (what a resume continues from)."""
        return Path(self.summary["checkpoint"])

    @property
    def best_checkpoint(self) -> Path | None:
        """The best checkpoint by train.monitor / train.mode (what inference should use)."""
        best = self.summary.get("best_checkpoint")
        return Path(best) if best else None


@contextmanager
def ray_session(address: str | None, env: Environment) -> Iterator[Environment]:
    """Connect to ``address`` (or ``RAY_ADDRESS``), reuse a live session, or start Ray here.

    Yields the environment with the cluster's resources; shuts down only a Ray it started.
    """
    started = embedded = False
    added_defaults: list[str] = []
    if not ray.is_initialized():
        target = address or env.ray_address
        # Ray would retry an unreachable address for minutes; probe it first
        check_reachable(target, source="--address" if address else "RAY_ADDRESS")
        try:
            if target:
                ray.init(address=target, logging_level=logging.WARNING)
            else:
                # An embedded single-machine cluster sized like the plan assumed. It keeps
                # Ray's dashboard (the run's workers, logs, stacks; leaving it out saved no
                # measurable start-up time). Its job server runs code, so it binds to
                # localhost unless the user opts in.
                ray.init(
                    num_cpus=int(env.resources.cpus),
                    dashboard_host=env.dashboard_host,
                    logging_level=logging.WARNING,
                )
                embedded = True
                added_defaults = apply_ray_train_defaults(embedded=True)
        except (ConnectionError, OSError, RuntimeError, ValueError) as exc:
            where = f"the Ray cluster at {target}" if target else "a local Ray"
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunFailedError(f"could not start or reach {where}: {reason}") from exc
        started = True
    try:
        resources, gpu = ray_cluster_resources()
        if embedded:
            # Nothing can join an embedded Ray: plan against this machine, so asking for
            # more workers than it has fails now instead of waiting forever.
            resources = replace(resources, source="this machine")
        yield replace(env.with_resources(resources, gpu), embedded_ray=ray_started_here())
    finally:
        if started:
            ray.shutdown()
        unset_ray_train_defaults(added_defaults)


def ray_started_here() -> bool:
    """Whether this process started the Ray it is connected to (``ray.init()`` without an
    address, by raytrain or by the user): that Ray ends with this process."""
    node = getattr(ray._private.worker, "_global_node", None)  # Ray has no public query
    return bool(node is not None and node.head)


def connected_plan(cfg: RaytrainConfig, address: str | None) -> tuple[Environment, TrainingPlan]:
    """Plan against a running cluster when one is named, else against this machine."""
    env = detect_environment()
    if address or env.ray_address:
        with ray_session(address, env) as cluster_env:
            return cluster_env, make_plan(cfg, cluster_env)
    return env, make_plan(cfg, env)


def preflight(cfg: RaytrainConfig, run_dir: RunDirectory, plan: TrainingPlan) -> FactoryRef:
    """Prepare the data and build data and model once on the driver.

    Catches a broken workload (bad params, failing import, too little data) before any
    worker starts, as a one-line BadInputError instead of retried worker failures.
    """
    data_ref = prepare_data(cfg.data, run_dir.data, cfg.experiment.seed)
    splits = _checked("data", build_data, data_ref, cfg.experiment.seed)
    spec = _checked("model", build_model, model_factory(cfg.model), dict(splits.info))
    if plan.gradient_checkpointing and not callable(
        getattr(spec.module, "gradient_checkpointing_enable", None)
    ):
        raise BadInputError(
            f"optimizations.gradient_checkpointing is true but {type(spec.module).__name__} has "
            f"no gradient_checkpointing_enable() method; add one (see raytrain_app/protocol.py) "
            f"or set optimizations.gradient_checkpointing=false"
        )
    check_monitor_on_one_batch(cfg.train.monitor, spec, splits.val)
    steps_per_epoch(len(splits.train), plan.effective_batch_size)
    return data_ref


def _checked(section: str, factory: Any, *args: Any) -> Any:
    """Call a workload factory; its ValueError/TypeError becomes a one-line bad-input error."""
    try:
        return factory(*args)
    except BadInputError:
        raise
    except (ValueError, TypeError, KeyError, FileNotFoundError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInputError(
            f"{section}: {message}; fix the {section} section of the config"
        ) from exc


def _root_cause(exc: BaseException) -> BaseException:
    """The user's exception inside Ray's wrappers (worker group / task errors)."""
    seen = exc
    for _ in range(10):
        inner = getattr(seen, "cause", None) or seen.__cause__
        if hasattr(seen, "worker_failures"):
            failures = list(seen.worker_failures.values())
            inner = failures[0] if failures else inner
        if inner is None or inner is seen:
            return seen
        seen = inner
    return seen


# How gloo and NCCL word a collective that waited past the process group's timeout.
_COLLECTIVE_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def user_facing_error(exc: BaseException, timeout_s: int | None = None) -> Exception:
    """One-line error for a failure raised inside Ray workers, keeping our own error kinds."""
    cause = _root_cause(exc)
    if isinstance(cause, BadInputError | RunFailedError):
        return cause
    if timeout_s is not None and _COLLECTIVE_TIMEOUT.search(str(cause)):
        return RunFailedError(
            f"a collective operation waited longer than distributed.timeout_s={timeout_s} s, "
            f"so a worker stalled, hung or died; look for the stalled rank in the worker logs, "
            f"or raise distributed.timeout_s if a step legitimately takes that long"
        )
    return RunFailedError(f"training failed: {type(cause).__name__}: {cause}".splitlines()[0])


# The signals that ask a run to checkpoint at the next step and stop: Ctrl-C, SLURM's
# warning before a time limit or preemption (the script asks for SIGUSR1), and SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)


@contextmanager
def stop_on_signals(stop_file: Path) -> Iterator[list[str]]:
    """Any of ``STOP_SIGNALS`` asks the workers to checkpoint at the next step and stop;
    a second one interrupts at once.

    Yields the names of the signals received. Outside the main thread (a notebook's
    worker thread) signals cannot be caught and nothing is installed.
    """
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def request_stop(signum: int, frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        if len(received) > 1:
            raise KeyboardInterrupt
        stop_file.touch()  # rank 0 polls for it between steps

    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_trainer(
    task: WorkerTask,
    cfg: RaytrainConfig,
    run_dir: RunDirectory,
    progress: bool,
    embedded_ray: bool,
) -> tuple[ray.train.Result, str | None]:
    """Run the TorchTrainer; returns its result and the stop signal received, if any."""
    plan = task.plan
    run_config = ray.train.RunConfig(
        name=cfg.experiment.name,
        storage_path=str(run_dir.checkpoints),
        failure_config=ray.train.FailureConfig(max_failures=cfg.fault_tolerance.max_failures),
        # Ray keeps the keep_checkpoints best by SCORE_KEY and always the newest as well.
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=cfg.train.keep_checkpoints,
            checkpoint_score_attribute=SCORE_KEY,
            checkpoint_score_order="max",
        ),
        # Ray Train's per-report INFO lines would drown raytrain's own epoch lines.
        logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        worker_runtime_env={"env_vars": training_worker_env_vars()},
    )
    scaling = ray.train.ScalingConfig(
        num_workers=plan.world_size,
        use_gpu=plan.use_gpu,
        resources_per_worker={
            "CPU": plan.cpus_per_worker,
            **({"GPU": plan.gpus_per_worker} if plan.use_gpu else {}),
        },
    )
    stop_file = run_dir.stop_request
    stop_file.unlink(missing_ok=True)  # a request the previous run never got to honour
    task.stop_file = str(stop_file)
    with DriverProgress(enabled=progress) as bar, stop_on_signals(stop_file) as received:
        task.progress = bar.tracker
        trainer = RaytrainTorchTrainer(
            _train_loop_entry,
            train_loop_config={"task": task},
            torch_config=TorchConfig(backend=plan.backend, timeout_s=plan.timeout_s),
            scaling_config=scaling,
            run_config=run_config,
            embedded_ray=embedded_ray,
        )
        result = trainer.fit()
    stop_file.unlink(missing_ok=True)
    return result, received[0] if received else None


def _train_loop_entry(config: dict[str, Any]) -> dict[str, Any]:
    return train_worker(config["task"])


def _summary(result: ray.train.Result, plan: TrainingPlan, wall: float) -> dict[str, Any]:
    returned = result.return_value or {}
    history = returned.get("history", [])
    total_samples = sum(row["samples_per_s"] * row["epoch_time_s"] for row in history)
    train_time = sum(row["epoch_time_s"] for row in history)
    return {
        "status": "stopped" if returned.get("stopped") else "completed",
        "final_metrics": history[-1] if history else {},
        "epochs_completed": len(history),
        "world_size": plan.world_size,
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
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "worker_nodes": returned.get("worker_nodes", []),
    }


def _best_summary(run_dir: RunDirectory, cfg: RaytrainConfig) -> dict[str, Any]:
    """``best_checkpoint`` and its monitored value (``best_metric``) for summary.json."""
    best = best_checkpoint(run_dir.checkpoints, cfg.train.monitor, cfg.train.mode)
    return {
        "best_checkpoint": str(best.path) if best else None,
        "best_metric": best.to_summary() if best else None,
    }


def train(cfg: RaytrainConfig, *, address: str | None = None, progress: bool = True) -> TrainResult:
    """Train ``cfg`` with DDP on Ray; resumes the run of the same name and config if any.

    Raises:
        BadInputError: the config, data or model is invalid (nothing was written).
        RunFailedError: the run started and failed.
    """
    start = time.perf_counter()
    check_tracking_installed(cfg)
    env = detect_environment()
    if not (address or env.ray_address or ray.is_initialized()):
        # Ray will run on this machine: plan against it first, so bad input fails in a
        # second instead of after Ray's start-up.
        local_plan = make_plan(cfg, env)
        RunDirectory.for_config(cfg).check_resumable(resolve_config(cfg, local_plan))
    apply_ray_train_defaults()
    with ray_session(address, env) as cluster_env:
        plan = make_plan(cfg, cluster_env)
        resolved = resolve_config(cfg, plan)
        run_dir = RunDirectory.for_config(resolved)
        resuming = run_dir.check_resumable(resolved)
        data_ref = preflight(resolved, run_dir, plan)
        run_dir.write_config(resolved)
        logger.info("%s run in %s", "resuming" if resuming else "starting", run_dir.root)
        task = WorkerTask(
            config=config_to_dict(resolved),
            plan=plan,
            data=data_ref,
            model=model_factory(resolved.model),
            run_dir=str(run_dir.root),
        )
        try:
            result, stop_signal = _run_trainer(
                task, resolved, run_dir, progress, cluster_env.embedded_ray
            )
        except ray.train.TrainingFailedError as exc:
            raise user_facing_error(exc, plan.timeout_s) from exc
    summary = _summary(result, plan, time.perf_counter() - start)
    summary.update(_best_summary(run_dir, resolved))
    run_dir.write_summary(summary)
    if resolved.tracking.loss_plot:
        write_loss_plot(run_dir.root, read_metrics(run_dir.root))
    if summary["status"] == "stopped":
        raise RunStoppedError(
            f"stopped on request ({stop_signal}) after {summary['epochs_completed']} complete "
            f"epoch(s), with a checkpoint at {summary['checkpoint']}; run the same command "
            f"again to resume",
            interrupted=stop_signal == "SIGINT",
        )
    return TrainResult(run_dir=run_dir.root, summary=summary, metrics=read_metrics(run_dir.root))
