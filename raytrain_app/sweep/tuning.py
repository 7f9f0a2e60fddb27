"""``raytrain tune``: Ray Tune sweeps whose trials are single workers running the train loop.

Each trial is a plain Tune function trainable that runs ``loop.WorkerLoop`` itself on one
device (a GPU, or CPUs), with no DDP inside a trial: trials run side by side, each
reserving ``scaling.cpus_per_worker`` and ``scaling.gpus_per_worker`` (a fraction packs
several small trials onto one GPU). (A TorchTrainer per trial is several times slower
on a small machine and can deadlock on trial resources: benchmarks/README.md.) The best
trial becomes ``best_config.yaml``, a complete train config that keeps the trial's global
batch and lr whatever the number of workers it is later trained on.

Trials track like ``raytrain train`` runs (the same trackers, in the loop), each one run
named after the trial: TensorBoard in ``trials/<id>/tensorboard``, one MLflow experiment
per sweep (``<sweep dir>/mlruns`` by default) and one W&B group per sweep.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import ray
from ray import tune

from raytrain_app.checkpoint.ranking import checkpoint_retention
from raytrain_app.config import (
    ConfigError,
    RaytrainConfig,
    config_from_dict,
    config_to_dict,
    config_with_values,
    dump_config_yaml,
)
from raytrain_app.driver.ray_datasets import load_data_splits
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.driver.run_lease import check_lease_held, hold_run_lease
from raytrain_app.driver.shared_storage import check_shared
from raytrain_app.driver.training import ray_session
from raytrain_app.errors import RunFailedError
from raytrain_app.planning.environment import (
    Environment,
    Resources,
    detect_environment,
    storage_env_vars,
)
from raytrain_app.planning.rules import (
    PlanError,
    available_devices,
    choose_use_gpu,
    make_plan,
    resolve_config,
)
from raytrain_app.storage import StorageLocation
from raytrain_app.sweep.restore_trust import check_restorable
from raytrain_app.sweep.search_space import build_search_space, trial_config
from raytrain_app.tracking.trackers import (
    SweepTrial,
    check_tracking_installed,
    prepare_sweep_tracking,
)
from raytrain_app.worker.early_stopping import EarlyStopping
from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.worker.session import TuneTrialSession
from raytrain_app.workloads import check_sources, model_factory, prepare_data

logger = logging.getLogger(__name__)

TRIALS_FILE = "trials.csv"
BEST_CONFIG_FILE = "best_config.yaml"
_EXPERIMENT_DIR = "tune"
# How long a trial that Tune stops may take to close its trackers (and upload their files).
_CLOSE_TIMEOUT_S = 60
# Clear while a trial's loop runs in this process (a trial process runs one at a time).
_LOOP_ENDED = threading.Event()
_LOOP_ENDED.set()


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


def single_worker(cfg: RaytrainConfig) -> RaytrainConfig:
    """The trial's execution config: one unwrapped worker, the rest as sampled."""
    return config_with_values(cfg, {"scaling.num_workers": 1, "distributed.strategy": "single"})


def trial_environment(env: Environment, cfg: RaytrainConfig, use_gpu: bool) -> Environment:
    """What one trial sees: exactly what Tune reserved for it: its GPUs, or the one GPU
    that trials reserving a fraction of it share (the plan keeps the fraction in
    ``gpus_per_worker``, and the memory probe budgets by it)."""
    gpus = max(1.0, cfg.scaling.gpus_per_worker) if use_gpu else 0.0
    trial = Resources(cpus=cfg.scaling.cpus_per_worker, gpus=gpus, nodes=1, source="this machine")
    return env.with_resources(trial, env.gpu)


def trial_resources(cfg: RaytrainConfig, use_gpu: bool) -> dict[str, float]:
    """What Tune reserves for one trial: ``scaling.cpus_per_worker`` and, on GPUs,
    ``scaling.gpus_per_worker``; a fraction packs several small trials onto one GPU."""
    resources = {"cpu": cfg.scaling.cpus_per_worker}
    if use_gpu:
        resources["gpu"] = cfg.scaling.gpus_per_worker
    return resources


def concurrent_trials(cfg: RaytrainConfig, env: Environment, use_gpu: bool) -> int:
    """How many trials the resources host at once: by CPUs and, on GPUs, by GPU shares.

    Ray places a fraction of a GPU on one GPU, never across two: shares of 0.3 fit 3
    trials on a GPU, not 3.33.
    """
    cpu_slots = available_devices(env, False, cfg.scaling)
    if not use_gpu:
        return cpu_slots
    return min(cpu_slots, available_devices(env, True, cfg.scaling))


def check_trial_slots(cfg: RaytrainConfig, env: Environment, use_gpu: bool) -> None:
    """Refuse trials that can never run here; warn when a cluster has no room for one yet.

    Raises:
        PlanError: one trial needs more GPUs than this machine or SLURM allocation has.
    """
    if concurrent_trials(cfg, env, use_gpu) > 0:
        return
    needs = f"scaling.gpus_per_worker={cfg.scaling.gpus_per_worker:g}"
    if env.resources.source != "ray cluster":  # a machine or an allocation never grows
        raise PlanError(
            f"{needs} is more GPUs than one trial can have on {env.resources.source} "
            f"({env.resources.gpus:g} GPUs); lower scaling.gpus_per_worker"
        )
    logger.warning(
        "%s is more GPUs than the cluster has free now (%g); trials start once it has grown",
        needs,
        env.resources.gpus,
    )


def run_trial(
    sampled: dict[str, Any],
    *,
    base: dict,
    env: Environment,
    use_gpu: bool,
    run_dir: str,
    storage_env: dict[str, str],
    mlflow_store: str | None = None,
) -> None:
    """The Tune trainable: build the trial's config and plan, run the worker loop.

    Tune reuses a trial's process for later trials (``reuse_actors``): nothing here or in
    the loop keeps state between trials (threads, seeds and logging are set per trial).
    ``storage_env`` is the driver's AWS_* variables: a trial on a running cluster does not
    see the driver's environment, and reads and writes the run's storage with them.
    ``mlflow_store``: the MLflow file store the sweep's trials share, if any.
    """
    os.environ.update(storage_env)
    # A trial that Tune stops at a report closes its trackers (and uploads their files)
    # before this process may run the next trial; Tune's default wait for that is 2 s.
    os.environ.setdefault("TUNE_FUNCTION_THREAD_TIMEOUT_S", str(_CLOSE_TIMEOUT_S))
    # The previous trial's loop holds reference cycles (its lr schedule refers back to it),
    # so only the collector frees its model, optimizer and data: do it before building more.
    gc.collect()
    if "torch._dynamo" in sys.modules:  # torch.compile's caches of the previous trial's model
        sys.modules["torch._dynamo"].reset()
    cfg = single_worker(trial_config(config_from_dict(base), sampled))
    plan = make_plan(cfg, trial_environment(env, cfg, use_gpu))
    run = StorageLocation.parse(run_dir, "experiment.output_dir")
    trial_id = tune.get_context().get_trial_id()
    trial_dir = run.child("trials", trial_id)
    task = WorkerTask(
        config=config_to_dict(resolve_config(cfg, plan)),
        plan=plan,
        # Cached and written atomically, so concurrent trials generate the data once.
        data=prepare_data(cfg.data, run.child("data"), cfg.experiment.seed, task_env=storage_env),
        model=model_factory(cfg.model),
        run_dir=trial_dir.uri,
        # Tune's trial table shows progress; per-epoch lines from every trial would bury it.
        log_level=logging.WARNING,
        # Its trackers' runs: named after the trial, gathered by the sweep. Their ids are
        # kept in the trial's folder, so a paused or resumed trial continues its own runs.
        trial=SweepTrial(cfg.experiment.name, trial_id, mlflow_store),
    )
    _LOOP_ENDED.clear()
    try:
        WorkerLoop(task, TuneTrialSession(plan.use_gpu)).run()
    finally:
        _LOOP_ENDED.set()


def _trial_trainable(run: Any) -> type:
    """Tune's trainable class of the function ``run``, whose stop waits for the loop's end.

    Tune stops a trial at a report (ASHA, PBT, the end of the sweep) by ending its thread
    there without waiting for it, and may then kill the process: W&B's service (a child
    process) died under a loop still closing its trackers, losing the whole offline run.
    """

    class Trial(tune.trainable.wrap_function(run)):
        def cleanup(self) -> None:
            try:
                super().cleanup()  # tells the loop's thread to end
            finally:
                _wait_for_loop_end()

    return Trial


def _wait_for_loop_end() -> None:
    # A function of this module: the trainable class above travels by value, this by name.
    _LOOP_ENDED.wait(_CLOSE_TIMEOUT_S)


def _scheduler(cfg: RaytrainConfig, space: dict[str, Any]) -> Any:
    t = cfg.tune
    if t.scheduler == "asha":
        return tune.schedulers.ASHAScheduler(
            time_attr="training_iteration",
            max_t=cfg.train.epochs,
            grace_period=t.grace_period,
            reduction_factor=t.reduction_factor,
        )
    if t.scheduler == "pbt":
        mutations = {k: v for k, v in space.items() if isinstance(v, tune.search.sample.Domain)}
        if not mutations:
            raise ConfigError(
                "tune.scheduler=pbt needs at least one distribution in "
                "tune.param_space to mutate (grid values cannot be mutated)"
            )
        return tune.schedulers.PopulationBasedTraining(
            time_attr="training_iteration",
            perturbation_interval=cfg.train.checkpoint_every_epochs,
            hyperparam_mutations=mutations,
        )
    return tune.schedulers.FIFOScheduler()


def _search_algorithm(cfg: RaytrainConfig) -> Any:
    if cfg.tune.search != "optuna":
        return None  # Tune's BasicVariantGenerator: random sampling and grid expansion
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError(
            "tune.search=optuna needs optuna; install it with pip install "
            "'raytrain_app[optuna]' or use tune.search: random"
        )
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch()


def _check_sweep(cfg: RaytrainConfig, env: Environment) -> dict[str, Any]:
    """Every check of the sweep against ``env`` (this machine, or the connected cluster):
    the space, the single-worker plan of the base, and room for a trial."""
    space = build_search_space(cfg)
    base = single_worker(cfg)
    use_gpu = choose_use_gpu(base, env)
    make_plan(base, trial_environment(env, base, use_gpu))
    check_trial_slots(base, env, use_gpu)
    _scheduler(cfg, space)
    _search_algorithm(cfg)
    return space


def _tuner(
    cfg: RaytrainConfig, space: dict, run_dir: RunDirectory, env: Environment, trust_code: bool
) -> Any:
    use_gpu = choose_use_gpu(cfg, env)
    local = run_dir.location.is_local
    trainable = tune.with_resources(
        _trial_trainable(
            tune.with_parameters(
                run_trial,
                base=config_to_dict(cfg),
                env=env,
                use_gpu=use_gpu,
                run_dir=run_dir.location.uri,
                storage_env=storage_env_vars(),
                mlflow_store=prepare_sweep_tracking(cfg, run_dir.root if local else None),
            )
        ),
        trial_resources(cfg, use_gpu),
    )
    # Ray's own storage: a path in the filesystem, and the filesystem unless it is local.
    filesystem = None if local else run_dir.location.filesystem
    path = run_dir.at(_EXPERIMENT_DIR)
    if tune.Tuner.can_restore(path.path, storage_filesystem=filesystem):
        check_restorable(path, trust_code)  # Tune unpickles what it restores
        logger.info("resuming the sweep in %s", path)
        return tune.Tuner.restore(
            path.path,
            trainable,
            resume_unfinished=True,
            resume_errored=False,
            param_space=space,
            storage_filesystem=filesystem,
        )
    # At least 1: a cluster without room yet (check_trial_slots warned) grows into it.
    concurrency = cfg.tune.max_concurrent_trials or max(1, concurrent_trials(cfg, env, use_gpu))
    tune_config = tune.TuneConfig(
        metric=cfg.tune.metric,
        mode=cfg.tune.mode,
        num_samples=1 if cfg.tune.search == "grid" else cfg.tune.num_samples,
        scheduler=_scheduler(cfg, space),
        search_alg=_search_algorithm(cfg),
        max_concurrent_trials=concurrency,
        # A finished trial's process runs the next trial: no new process importing torch
        # and Ray per trial (benchmarks/tune_overhead.py measures what that saves).
        reuse_actors=True,
    )
    run_config = tune.RunConfig(
        name=_EXPERIMENT_DIR,
        storage_path=run_dir.location.path,
        storage_filesystem=filesystem,
        failure_config=tune.FailureConfig(max_failures=cfg.tune.max_failures),
        checkpoint_config=tune.CheckpointConfig(**checkpoint_retention(cfg.train)),
    )
    logger.info(
        "sweep of %s with up to %d concurrent single-worker trials", ", ".join(space), concurrency
    )
    return tune.Tuner(trainable, param_space=space, tune_config=tune_config, run_config=run_config)


def _fit_noting_interrupt(tuner: tune.Tuner) -> tuple[Any, bool]:
    """Run the sweep; also return whether Ctrl-C ended it early.

    Tune catches SIGINT itself, saves its state and returns a normal-looking grid. Its
    handler puts the previous handler back only when a signal arrived: that is the tell.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT)
    try:
        grid = tuner.fit()
    finally:
        interrupted = in_main_thread and signal.getsignal(signal.SIGINT) is before
        if in_main_thread:
            signal.signal(signal.SIGINT, before)  # Tune leaves its own handler installed
    return grid, interrupted


def _trial_row(
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
    elif epochs >= cfg.train.epochs or _stopped_by_rule(cfg, history, epochs):
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


def _stopped_by_rule(cfg: RaytrainConfig, history: Any, epochs: int) -> bool:
    """Whether the trial's own early-stopping rule ended it after ``epochs`` (not ASHA)."""
    if cfg.train.early_stopping is None or history is None or not len(history):
        return False
    return EarlyStopping.of(cfg.train).stopped_at(history.to_dict("records")) == epochs


def _best_config(cfg: RaytrainConfig, sampled: dict[str, Any]) -> RaytrainConfig:
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


def tune_sweep(
    cfg: RaytrainConfig, *, address: str | None = None, trust_code: bool = False
) -> TuneResult:
    """Run (or resume) the sweep of ``cfg.tune`` and write its results to the run directory.

    ``trust_code``: resume from Tune state that is not provably this user's (a bucket's),
    which Tune unpickles (``restore_trust.py``).

    Raises:
        BadInputError: invalid space, config or resources (before any trial starts).
        RunFailedError: every trial failed.
    """
    check_sources(cfg.model, cfg.data)  # a wrong target or data path fails before Ray starts
    check_tracking_installed(cfg)
    env = detect_environment()
    if not (address or env.ray_address or ray.is_initialized()):
        # Ray will run on this machine: check against it first, so bad input fails in a
        # second instead of after Ray's start-up. A cluster (its GPUs) is checked once
        # connected: the driver may sit on a CPU-only login or head node.
        _check_sweep(cfg, env)
    run_dir = RunDirectory.for_config(cfg)
    run_dir.check_resumable(cfg)
    with ray_session(address, env) as cluster_env:
        space = _check_sweep(cfg, cluster_env)
        # One writer at a time; a second train or tune of this directory exits 2 here.
        with hold_run_lease(run_dir.location.uri, "tune"):
            run_dir.check_resumable(cfg)  # again under the lease: racing sweeps pass it once
            return _sweep(cfg, space, run_dir, cluster_env, trust_code)


def _sweep(
    cfg: RaytrainConfig,
    space: dict[str, Any],
    run_dir: RunDirectory,
    cluster_env: Environment,
    trust_code: bool,
) -> TuneResult:
    """Run the sweep on the connected Ray, then write trials.csv and best_config.yaml."""
    if run_dir.location.is_local:  # trials on other nodes write there too
        check_shared(run_dir.location.local_path.parent, cfg.experiment.output_dir)
    run_dir.write_config(cfg)
    # Once here, on the cluster's CPUs, rather than in the first trials at once: streaming
    # data is prepared (Ray Data) and the synthetic data generated; trials find it cached,
    # unless their sampled data.params differ (then each prepares its own, once).
    data_ref = prepare_data(
        cfg.data, run_dir.at("data"), cfg.experiment.seed, task_env=storage_env_vars()
    )
    if cfg.data.target:  # a factory returning Ray Datasets is refused here, not per trial
        load_data_splits(data_ref, cfg.experiment.seed, cfg.train.global_batch_size, "tune")
    grid, interrupted = _fit_noting_interrupt(_tuner(cfg, space, run_dir, cluster_env, trust_code))
    keys = list(space)
    trials = pd.DataFrame([_trial_row(r, keys, cfg, interrupted) for r in grid])
    trials_file = run_dir.at(TRIALS_FILE)
    check_lease_held()  # a sweep whose directory another run took over writes no results
    trials_file.write_text(trials.to_csv(index=False))
    if interrupted:
        raise KeyboardInterrupt
    finite = [
        r
        for r in grid
        if r.error is None and r.metrics and math.isfinite(r.metrics.get(cfg.tune.metric, math.nan))
    ]
    if not finite:
        raise RunFailedError(
            f"all {len(grid)} trials failed or reported no {cfg.tune.metric}; see "
            f"{trials_file} for each trial's error"
        )
    best = grid.get_best_result(
        metric=cfg.tune.metric, mode=cfg.tune.mode, scope="last", filter_nan_and_inf=True
    )
    best_config = _best_config(cfg, {k: best.config[k] for k in keys})
    best_file = run_dir.at(BEST_CONFIG_FILE)
    best_file.write_text(dump_config_yaml(best_config))
    local = run_dir.location.is_local
    return TuneResult(
        run_dir=run_dir.root if local else run_dir.location.uri,
        trials=trials,
        best_config=best_config,
        best_config_path=best_file.local_path if local else best_file.uri,
        best_metrics=dict(best.metrics),
    )
