"""``raytrain train --local``: the run in Ray Train's local mode, for debugging.

The same config, plan, run directory, checkpoints and resume as a run on Ray, with the
training function in this process (``ScalingConfig(num_workers=0)``): no Ray to start, so
the first step comes in seconds, and ``breakpoint()`` or ``pdb`` in a model's step stop in
this terminal. ``--nproc N`` runs N such processes under torchrun, which Ray Train's local
mode joins into one process group; rank 0 does the driver's part (lease, checks, config,
summary), the others train.

Ray's own local mode keeps reports in memory; ``worker.local_mode`` persists checkpoints
into the run's storage, where a later run on Ray (or locally) resumes from them.

Ray's local mode picks the device by itself: CUDA whenever torch sees it (its backend,
``set_device`` and ``get_device``), whatever ``scaling.use_gpu`` says. A run planned for
CPU therefore runs as on a machine without CUDA (``_as_planned``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import ray.train
import torch
import torch.distributed as dist
from ray.train.torch import TorchTrainer

from raytrain_app import startup_gc
from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.signals import stop_on_signals
from raytrain_app.errors import BadInputError, RunFailedError, first_line
from raytrain_app.planning.choices import choose_use_gpu
from raytrain_app.planning.environment import (
    detect_environment,
    one_torch_thread_per_process,
    plain_breakpoints,
)
from raytrain_app.planning.gpus import check_local_processes
from raytrain_app.storage import StorageLocation
from raytrain_app.worker.local_mode import Retention, RunStorage, train_worker_local
from raytrain_app.worker.loop import WorkerTask
from raytrain_app.worker.session import newest_persisted

logger = logging.getLogger(__name__)

# Ray Train's local mode logs every report's metrics and that it runs locally, at INFO:
# raytrain's epoch lines already say both.
_CHATTY_RAY_LOGGERS = (
    "ray.train.v2._internal.execution.train_fn_utils",
    "ray.train.v2.api.config",
)


def torchrun_rank() -> int | None:
    """This process's rank under torchrun, or None outside torchrun."""
    torchrun = detect_environment().torchrun
    return torchrun.rank if torchrun else None


def local_processes_config(cfg: RaytrainConfig) -> RaytrainConfig:
    """``cfg`` planned for the processes local mode has (torchrun's, else this one): the
    same global batch, re-split; a later run on Ray with ``scaling.num_workers`` as the
    config says resumes it (the worker count may change across a resume).

    Raises:
        PlanError: on GPUs, more torchrun processes than GPUs; checked in every process,
            since the others would crash on their GPU before rank 0's plan refuses.
    """
    env = detect_environment()
    local = cfg.model_copy(deep=True)
    local.scaling.num_workers = env.torchrun.world_size if env.torchrun else 1
    if choose_use_gpu(local, env):
        check_local_processes(env)
    return local


def run_local(
    task: WorkerTask | None, cfg: RaytrainConfig, checkpoints: StorageLocation
) -> tuple[ray.train.Result, str | None]:
    """Run ``task`` in Ray Train's local mode; what ``trainer.run_trainer`` returns.

    Under torchrun every process calls this; only rank 0 has the task (its driver part
    prepared it) and hands it to the others once the process group exists.
    """
    for name in _CHATTY_RAY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    folder = checkpoints.child(cfg.experiment.name)
    retention = Retention(cfg.train.keep_checkpoints, cfg.train.monitor, cfg.train.mode)
    trainer = TorchTrainer(
        _local_entry,
        train_loop_config={"task": task, "checkpoints": folder.uri, "retention": retention},
        scaling_config=ray.train.ScalingConfig(num_workers=0),
        run_config=ray.train.RunConfig(name=cfg.experiment.name),
    )
    # One process: a stop signal checkpoints at the next step, as on Ray. Under torchrun
    # its agent owns the signals and stops every process.
    stop = threading.Event()
    alone = torchrun_rank() is None
    if task is not None and alone:
        task.control = stop
    # Every process decides alike (rank 0's task is not here yet in the others).
    use_gpu = choose_use_gpu(cfg, detect_environment())
    try:
        with (
            plain_breakpoints(),
            _as_planned(use_gpu),
            stop_on_signals(stop) if alone else nullcontext([]) as got,
        ):
            result = trainer.fit()
    except (BadInputError, RunFailedError, KeyboardInterrupt):
        raise
    except Exception as exc:  # the user's step, data or model failed: one line, --debug more
        raise RunFailedError(f"the training failed: {first_line(exc)}") from exc
    # A report without a checkpoint replaces Ray's last one in local mode: the run's
    # checkpoint is the newest in storage, what a resume continues from.
    newest = newest_persisted(None, storage=RunStorage(folder.filesystem, folder.path))
    return dataclasses.replace(result, checkpoint=newest), got[0] if got else None


@contextlib.contextmanager
def _as_planned(use_gpu: bool) -> Iterator[None]:
    """Ray Train's local mode on the plan's device while the block runs.

    Ray 2.60's local mode asks ``torch.cuda.is_available()`` for its process group's
    backend (nccl), for ``set_device(LOCAL_RANK)`` and for ``get_device()``: it ignores
    ``ScalingConfig.use_gpu`` (a TODO in ``ray.train.v2.torch.train_loop_utils``). For a
    CPU plan on a CUDA machine, torch reports no CUDA until the run ends: gloo, the CPU
    device, and no CUDA call from Ray or the loop.
    """
    if use_gpu or not torch.cuda.is_available():
        yield
        return
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    try:
        yield
    finally:
        torch.cuda.is_available = available


def _local_entry(config: dict[str, Any]) -> dict[str, Any]:
    # Paused until the loop's first step, as on a Ray worker (the loop resumes it then); the
    # block's end resumes it where the loop never ran: this process goes on, a notebook's or
    # a test session's, and must not wait for the 5-minute fallback.
    with startup_gc.paused():
        task = config["task"]
        if dist.is_available() and dist.is_initialized():
            shared = [task]  # no control under torchrun: nothing unpicklable
            dist.broadcast_object_list(shared, src=0)  # rank 0's task, checked and prepared
            task = shared[0]
        return train_worker_local(task, config["checkpoints"], config["retention"])


def run_under_torchrun(argv: list[str], nproc: int) -> int:
    """``raytrain <argv>`` in ``nproc`` processes on this machine, launched by torchrun's
    agent in this process; the first failed process's exit code, else 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Built, not parsed: torchrun's parser would take the command's --local for its own.
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "raytrain_app.cli"]
    )
    args.training_script_args = argv
    one_torch_thread_per_process()
    try:
        run(args)
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
