"""What runs a ``Launch`` of ``raytrain train``: Ray Train, or Ray Train's local mode.

``run_training`` checks the workload on the driver, writes ``config.yaml`` and hands the
workers their task: a ``TorchTrainer`` on the connected Ray (``driver.trainer``), or local
mode in this process, or in each of torchrun's (``driver.local_run``); torchrun's other
processes join rank 0's run through ``follow_rank_zero``. (A sweep's executor is Ray Tune:
``sweep.tuning``.)
"""

from __future__ import annotations

import logging

import ray.train

from raytrain_app.checkpoint.data_identity import ResumedData
from raytrain_app.driver.failures import user_facing_error
from raytrain_app.driver.launch import Launch
from raytrain_app.driver.local_run import run_local
from raytrain_app.driver.preflight import preflight
from raytrain_app.driver.ray_datasets import RayDataInputs
from raytrain_app.driver.stream_lanes import stream_lanes
from raytrain_app.driver.trainer import run_trainer
from raytrain_app.driver.worker_task import worker_task
from raytrain_app.worker.loop import WorkerTask

logger = logging.getLogger(__name__)


def run_training(launch: Launch, progress: bool) -> tuple[ray.train.Result, str | None]:
    """Run the launch's workers to the end; Ray's result and the stop signal, if any."""
    run_dir, resolved = launch.run_dir, launch.resolved
    # Before the prepare pass: a resume on changed files is refused before it starts.
    data = ResumedData.checked(
        resolved.data, run_dir.at("checkpoints"), run_dir.at("data"), launch.resuming
    )
    # Before the prepare pass too: a resume keeps its checkpoints' lanes, or is refused.
    checkpoints = run_dir.at("checkpoints") if launch.resuming else None
    lanes = stream_lanes(resolved, launch.plan, checkpoints)
    data_ref, ray_inputs = preflight(resolved, run_dir, launch.plan, launch.local, lanes)
    run_dir.write_config(resolved)
    how = " locally (Ray Train's local mode)" if launch.local else ""
    started = "resuming" if launch.resuming else "starting"
    logger.info("%s run%s in %s", started, how, run_dir.location)
    task = worker_task(
        resolved,
        launch.plan,
        data_ref,
        run_dir.location.uri,
        ray_data=ray_inputs.plan if ray_inputs else None,
        data_identity=data.prepared(data_ref),
        stream_lanes=lanes,
    )
    if launch.local:
        return run_local(task, resolved, run_dir.at("checkpoints"))
    return _run_on_ray_train(launch, task, ray_inputs, progress)


def _run_on_ray_train(
    launch: Launch, task: WorkerTask, ray_inputs: RayDataInputs | None, progress: bool
) -> tuple[ray.train.Result, str | None]:
    """The ``TorchTrainer`` on the connected Ray; a failed run as one user-facing error."""
    try:
        return run_trainer(
            task,
            launch.resolved,
            launch.run_dir.at("checkpoints"),
            progress,
            launch.env.embedded_ray,
            datasets=ray_inputs.datasets if ray_inputs else None,
            dataset_config=ray_inputs.dataset_config if ray_inputs else None,
        )
    except ray.train.TrainingFailedError as exc:
        raise user_facing_error(exc, launch.plan.timeout_s) from exc


def follow_rank_zero(launch: Launch) -> None:
    """One of torchrun's other processes: train in rank 0's run, with the task rank 0
    checked and prepared (it arrives once the process group exists)."""
    run_local(None, launch.cfg, launch.run_dir.at("checkpoints"))
