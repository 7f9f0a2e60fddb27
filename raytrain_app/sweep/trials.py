"""One trial of a sweep: its config, its resources, and the Tune trainable that runs it.

Each trial is a plain Tune function trainable that runs ``loop.WorkerLoop`` itself on one
device (a GPU, or CPUs), with no DDP inside a trial: trials run side by side, each
reserving ``scaling.cpus_per_worker`` and ``scaling.gpus_per_worker`` (a fraction packs
several small trials onto one GPU). (A TorchTrainer per trial is several times slower
on a small machine and can deadlock on trial resources: benchmarks/README.md.)
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
from typing import Any

from ray import tune

from raytrain_app.config import RaytrainConfig, config_from_dict, config_with_values
from raytrain_app.driver.worker_task import worker_task
from raytrain_app.planning.batch import PlanError
from raytrain_app.planning.environment import Environment, Resources
from raytrain_app.planning.rules import make_plan, resolve_config
from raytrain_app.planning.workers import available_devices
from raytrain_app.storage import StorageLocation
from raytrain_app.sweep.search_space import trial_config
from raytrain_app.tracking.trackers import SweepTrial
from raytrain_app.worker.loop import WorkerLoop
from raytrain_app.worker.session import TuneTrialSession
from raytrain_app.workloads import prepare_data

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 60
# Clear while a trial's loop runs in this process (a trial process runs one at a time).
_LOOP_ENDED = threading.Event()
_LOOP_ENDED.set()


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
    ``storage_env`` is the driver's variables for the sweep's stores (``storage_env_vars``:
    S3's when a location is in S3): a trial on a running cluster does not see the driver's
    environment, and reads and writes the run's storage with them.
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
    task = worker_task(
        resolve_config(cfg, plan),
        plan,
        # Cached and written atomically, so concurrent trials generate the data once.
        prepare_data(cfg.data, run.child("data"), cfg.experiment.seed, task_env=storage_env),
        trial_dir.uri,
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


def trial_trainable(run: Any) -> type:
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
