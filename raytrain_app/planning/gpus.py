"""The plan's GPU arithmetic and GPU-only choices, as pure functions.

How many workers the GPUs host at the share Ray reserves for each
(``scaling.gpus_per_worker``); what NCCL cannot do (two ranks on one GPU); torchrun's
processes under local mode, one GPU each; TF32; and the notes ``raytrain plan`` prints
where a choice needs its reason.
"""

from __future__ import annotations

import math

from raytrain_app.config import ScalingConfig
from raytrain_app.planning.batch import PlanError
from raytrain_app.planning.environment import Environment, GpuInfo, Resources

# Float division is inexact (1 / 0.1 is 10.000000000000002, 3 * 0.1 / 0.1 is 2.9999...):
# shares are compared with this much slack.
_EPSILON = 1e-9


def gpu_worker_slots(resources: Resources, share: float) -> int:
    """How many workers of ``share`` GPUs each ``resources`` host.

    Ray packs fractions onto one GPU, never across two (shares of 0.3 fit 3 on a GPU, not
    3.33), and places a worker's whole GPUs on one node.
    """
    per_node = resources.node_gpus or (resources.gpus,)
    if share <= 1:
        per_gpu = math.floor(1 / share + _EPSILON)
        return sum(int(gpus + _EPSILON) * per_gpu for gpus in per_node)
    return sum(int(gpus / share + _EPSILON) for gpus in per_node)


def check_gpus(
    scaling: ScalingConfig, env: Environment, use_gpu: bool, world_size: int, backend: str
) -> None:
    """Refuse, in one line, GPU counts that would crash or wait forever (the two below)."""
    if use_gpu:
        check_local_processes(env)
        check_gpu_share(scaling.gpus_per_worker, world_size, backend)


def check_gpu_share(share: float, world_size: int, backend: str) -> None:
    """Refuse a ``scaling.gpus_per_worker`` that Ray or NCCL cannot run.

    Ray reserves a fraction only below one GPU. NCCL refuses two ranks of a process group
    on one GPU ("Duplicate GPU detected"), which a fraction with several workers makes:
    Ray packs the fractions onto as few GPUs as it can.
    """
    if share > 1 and abs(share - round(share)) > _EPSILON:
        raise PlanError(
            f"scaling.gpus_per_worker={share:g} is neither a whole number nor a fraction "
            f"below 1, which Ray cannot reserve; set it to {math.floor(share)} or "
            f"{math.ceil(share)}"
        )
    if share < 1 and world_size > 1 and backend == "nccl":
        raise PlanError(
            f"scaling.gpus_per_worker={share:g} puts several of the {world_size} workers on "
            f"one GPU, which NCCL refuses; set scaling.gpus_per_worker=1, or "
            f"scaling.num_workers=1 to share a GPU with one worker"
        )


def check_local_processes(env: Environment) -> None:
    """Under torchrun (``raytrain train --local --nproc N``) each process trains on the GPU
    of its local rank: refuse more processes than this machine has GPUs (the extra ones
    would crash on a device ordinal that does not exist)."""
    torchrun = env.torchrun
    if torchrun is None:
        return
    gpus = int((env.machine or env.resources).gpus)
    processes = torchrun.local_world_size or torchrun.world_size
    if processes > gpus:
        raise PlanError(
            f"--nproc {processes} starts more processes than the {gpus} GPU(s) of this "
            f"machine, one GPU each; lower --nproc (torchrun's --nproc-per-node) to {gpus}, "
            f"or set scaling.use_gpu=false to train on CPU"
        )


def choose_tf32(requested_precision: str, use_gpu: bool, gpu: GpuInfo | None) -> bool:
    """TF32 for float32 matmuls and convolutions, on Ampere or newer: on under ``auto``,
    bf16 and fp16, where it speeds up what runs outside autocast; off under an explicit
    ``precision: fp32``, which asks for exact float32."""
    capable = bool(use_gpu and gpu and gpu.capability >= (8, 0))
    return capable and requested_precision != "fp32"


def gpu_notes(
    requested_precision: str,
    gpu: GpuInfo | None,
    share: float,
    compiled: bool,
    sync_batchnorm: bool,
) -> tuple[str, ...]:
    """One line for each GPU choice whose reason the plan's summary does not show.

    ``gpu``: the workers' GPU, None when they train on CPU; ``share``: the GPUs each
    worker reserves (0 on CPU).
    """
    notes = []
    if gpu and gpu.capability >= (8, 0) and requested_precision == "fp32":
        notes.append(
            "TF32 off: precision=fp32 keeps float32 matmuls and convolutions exact; "
            "precision auto or bf16 turns TF32 on for them"
        )
    if share > 1:
        notes.append(
            f"each worker reserves {share:g} GPUs and trains on one of them (DDP runs one "
            f"process per GPU); scaling.gpus_per_worker=1 puts every GPU to work"
        )
    if compiled and sync_batchnorm:
        notes.append(
            "SyncBatchNorm layers, if the model has BatchNorm, run outside torch.compile's "
            "graphs, one graph break each (dynamo cannot trace how they gather "
            "statistics across workers); the rest of the model is compiled"
        )
    return tuple(notes)
