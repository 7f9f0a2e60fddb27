"""The Ray Tune ``Tuner`` of a sweep: scheduler, search algorithm, resources, storage.

A sweep saved in the run directory is restored (after ``restore_trust`` allows it); a
new one runs ``tune.num_samples`` single-worker trials, as many at once as the resources
host.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import threading
from typing import Any

from ray import tune

from raytrain_app.checkpoint.ranking import checkpoint_retention
from raytrain_app.config import ConfigError, RaytrainConfig, config_to_dict
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.planning.choices import choose_use_gpu
from raytrain_app.planning.environment import Environment
from raytrain_app.planning.rules import make_plan
from raytrain_app.planning.store_variables import storage_env_vars
from raytrain_app.sweep.restore_trust import check_restorable
from raytrain_app.sweep.search_space import build_search_space
from raytrain_app.sweep.trials import (
    check_trial_slots,
    concurrent_trials,
    run_trial,
    single_worker,
    trial_environment,
    trial_resources,
    trial_trainable,
)
from raytrain_app.tracking.trackers import prepare_sweep_tracking

logger = logging.getLogger(__name__)

EXPERIMENT_DIR = "tune"


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


def search_algorithm(cfg: RaytrainConfig) -> Any:
    if cfg.tune.search != "optuna":
        return None  # Tune's BasicVariantGenerator: random sampling and grid expansion
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError(
            "tune.search=optuna needs optuna; install it with pip install "
            "'raytrain_app[optuna]' or use tune.search: random"
        )
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch()


def check_sweep(cfg: RaytrainConfig, env: Environment) -> dict[str, Any]:
    """Every check of the sweep against ``env`` (this machine, or the connected cluster):
    the space, the single-worker plan of the base, and room for a trial."""
    space = build_search_space(cfg)
    base = single_worker(cfg)
    use_gpu = choose_use_gpu(base, env)
    make_plan(base, trial_environment(env, base, use_gpu))
    check_trial_slots(base, env, use_gpu)
    _scheduler(cfg, space)
    search_algorithm(cfg)
    return space


def build_tuner(
    cfg: RaytrainConfig, space: dict, run_dir: RunDirectory, env: Environment, trust_code: bool
) -> Any:
    use_gpu = choose_use_gpu(cfg, env)
    local = run_dir.location.is_local
    trainable = tune.with_resources(
        trial_trainable(
            tune.with_parameters(
                run_trial,
                base=config_to_dict(cfg),
                env=env,
                use_gpu=use_gpu,
                run_dir=run_dir.location.uri,
                storage_env=storage_env_vars(cfg),
                mlflow_store=prepare_sweep_tracking(cfg, run_dir.root if local else None),
            )
        ),
        trial_resources(cfg, use_gpu),
    )
    # Ray's own storage: a path in the filesystem, and the filesystem unless it is local.
    filesystem = None if local else run_dir.location.filesystem
    path = run_dir.at(EXPERIMENT_DIR)
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
        search_alg=search_algorithm(cfg),
        max_concurrent_trials=concurrency,
        # A finished trial's process runs the next trial: no new process importing torch
        # and Ray per trial (benchmarks/tune_overhead.py measures what that saves).
        reuse_actors=True,
    )
    run_config = tune.RunConfig(
        name=EXPERIMENT_DIR,
        storage_path=run_dir.location.path,
        storage_filesystem=filesystem,
        failure_config=tune.FailureConfig(max_failures=cfg.tune.max_failures),
        checkpoint_config=tune.CheckpointConfig(**checkpoint_retention(cfg.train)),
    )
    logger.info(
        "sweep of %s with up to %d concurrent single-worker trials", ", ".join(space), concurrency
    )
    return tune.Tuner(trainable, param_space=space, tune_config=tune_config, run_config=run_config)


def fit_noting_interrupt(tuner: tune.Tuner) -> tuple[Any, bool]:
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
