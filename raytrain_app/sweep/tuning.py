"""``tune_sweep()``: the steps of ``raytrain tune`` on the driver, top to bottom.

Each trial is a single worker running the train loop (``sweep/trials.py``); the sweep is
launched like a run (``driver/launch.py``: the checks before Ray, the plan against the
cluster, the lease), then Ray Tune runs it (``sweep/tuner.py``) and the results are written
(``sweep/results.py``): ``trials.csv`` and the best trial as ``best_config.yaml``, a
complete train config.

Trials track like ``raytrain train`` runs (the same trackers, in the loop), each one run
named after the trial: TensorBoard in ``trials/<id>/tensorboard``, one MLflow experiment
per sweep (``<sweep dir>/mlruns`` by default) and one W&B group per sweep.
"""

from __future__ import annotations

from typing import Any

from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.launch import Command, Launch
from raytrain_app.driver.ray_datasets import load_data_splits
from raytrain_app.planning.environment import Environment
from raytrain_app.planning.store_variables import storage_env_vars
from raytrain_app.sweep.results import TuneResult, record_sweep
from raytrain_app.sweep.tuner import build_tuner, check_sweep, fit_noting_interrupt
from raytrain_app.workloads import prepare_data


def plan_sweep(cfg: RaytrainConfig, env: Environment) -> tuple[dict[str, Any], RaytrainConfig]:
    """The sweep checked against ``env`` (its space, a trial's plan, room for a trial):
    its search space, and the config it writes, which is ``cfg`` as given."""
    return check_sweep(cfg, env), cfg


SWEEP = Command("tune", plan_sweep, resolves_config=False, ray_train=False)


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
    launch = Launch.checked(cfg, SWEEP, address=address)
    with launch.connected(), launch.lease():
        space, run_dir = launch.plan, launch.run_dir
        run_dir.write_config(cfg)
        _prepare_data_once(launch)
        tuner = build_tuner(cfg, space, run_dir, launch.env, trust_code)
        grid, interrupted = fit_noting_interrupt(tuner)
        return record_sweep(cfg, run_dir, grid, list(space), interrupted)


def _prepare_data_once(launch: Launch) -> None:
    """Prepare the data here, on the cluster's CPUs, rather than in the first trials at
    once: streaming data is prepared (Ray Data) and the synthetic data generated; trials
    find it cached, unless their sampled data.params differ (each prepares its own, once)."""
    cfg = launch.cfg
    data_ref = prepare_data(
        cfg.data, launch.run_dir.at("data"), cfg.experiment.seed, task_env=storage_env_vars(cfg)
    )
    if cfg.data.target:  # a factory returning Ray Datasets is refused here, not per trial
        load_data_splits(data_ref, cfg.experiment.seed, cfg.train.global_batch_size, "tune")
