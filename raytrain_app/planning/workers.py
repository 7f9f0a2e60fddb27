"""How many workers a run gets, and whether its target can host them.

``scaling.num_workers`` (a number, ``auto`` or an elastic ``[min, max]``) against the
devices of this machine, a SLURM allocation or a Ray cluster; pure functions, like the
rest of ``planning``.
"""

from __future__ import annotations

import logging

from raytrain_app.config import RaytrainConfig, ScalingConfig
from raytrain_app.config.base import MAX_BATCH_SIZE
from raytrain_app.planning.batch import PlanError, nearest_multiples
from raytrain_app.planning.environment import Environment
from raytrain_app.planning.gpus import gpu_worker_slots
from raytrain_app.planning.lanes import choose_lanes, lcm_at_most

logger = logging.getLogger(__name__)


def available_devices(env: Environment, use_gpu: bool, scaling: ScalingConfig) -> int:
    """How many workers the resources can host at the GPUs (or CPUs) Ray reserves for each
    (a worker never spans two nodes)."""
    if use_gpu:
        return gpu_worker_slots(env.resources, scaling.gpus_per_worker)
    per_node = env.resources.node_cpus or (env.resources.cpus,)
    return max(1, sum(int(cpus // scaling.cpus_per_worker) for cpus in per_node))


def worker_range(cfg: RaytrainConfig) -> tuple[int, int] | None:
    """``scaling.num_workers`` as ``(min, max)`` for an elastic run; None for a fixed size."""
    requested = cfg.scaling.num_workers
    return (requested[0], requested[1]) if isinstance(requested, list) else None


def choose_world_size(cfg: RaytrainConfig, env: Environment, use_gpu: bool) -> int:
    """``scaling.num_workers``, or for ``auto`` the most devices that split the batch evenly
    (and, for streaming data, that its lanes serve); for an elastic ``[min, max]``, max: the
    size a run starts with when there is room."""
    requested = cfg.scaling.num_workers
    devices = available_devices(env, use_gpu, cfg.scaling)
    if cfg.distributed.strategy == "single":
        if requested not in ("auto", 1):
            raise PlanError(
                f"distributed.strategy='single' trains on one worker but scaling.num_workers="
                f"{requested}; set scaling.num_workers=1 or distributed.strategy=ddp"
            )
        return 1
    if isinstance(requested, list):
        return requested[1]
    if requested != "auto":
        return requested
    global_batch = cfg.train.global_batch_size
    # data.streaming is decided (true or false) before a run plans (driver.training).
    streams = cfg.data.streaming is True
    return max(
        w
        for w in range(1, max(devices, 1) + 1)
        if global_batch % w == 0 and (not streams or choose_lanes(global_batch, (w,)))
    )


def check_elastic_range(cfg: RaytrainConfig, low: int, high: int) -> None:
    """Every world size Ray may pick in ``[low, high]`` must split the global batch, so that
    every size trains the same optimisation (under ``train.max_batch_per_worker`` a split
    always exists: accumulation takes up the rest), and the run must be able to restart."""
    global_batch = cfg.train.global_batch_size
    if cfg.fault_tolerance.max_failures == 0:
        raise PlanError(
            f"scaling.num_workers=[{low}, {high}] continues after a lost worker by restarting, "
            f"which fault_tolerance.max_failures=0 forbids; set fault_tolerance.max_failures "
            f"above 0 (-1: unlimited)"
        )
    if cfg.distributed.grad_compression == "powersgd":
        raise PlanError(
            f"distributed.grad_compression=powersgd keeps error-feedback state that a resize "
            f"of scaling.num_workers=[{low}, {high}] would drop; set "
            f"distributed.grad_compression=none or a fixed scaling.num_workers"
        )
    bad = [w for w in range(low, high + 1) if global_batch % w]
    if not bad:
        return
    lcm = lcm_at_most(range(low, high + 1), MAX_BATCH_SIZE)
    ranges = _valid_subranges(global_batch, low, high)
    narrower = f"scaling.num_workers={list(ranges[0])}" if ranges else "a fixed scaling.num_workers"
    if lcm is None:
        # no allowed batch is a multiple of every size: only a narrower range helps
        other = f" (no train.global_batch_size up to {MAX_BATCH_SIZE} splits over all of them)"
    else:
        batches = " or ".join(str(m) for m in nearest_multiples(global_batch, lcm))
        other = f" or set train.global_batch_size to a multiple of {lcm} (e.g. {batches})"
    raise PlanError(
        f"train.global_batch_size={global_batch} cannot be split evenly over "
        f"{_either(bad)} workers, which scaling.num_workers=[{low}, {high}] "
        f"allows; narrow it to {narrower}{other}"
    )


def _either(values: list[int], shown: int = 8) -> str:
    words = [str(v) for v in values[:shown]]
    if len(values) > shown:
        return f"{', '.join(words)} and {len(values) - shown} more"
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _valid_subranges(global_batch: int, low: int, high: int) -> list[tuple[int, int]]:
    """The runs of consecutive sizes inside ``[low, high]`` that split ``global_batch``,
    widest and then largest first (a single size is a fixed run, not a range)."""
    runs, start = [], None
    for w in range(low, high + 2):
        ok = w <= high and global_batch % w == 0
        if ok and start is None:
            start = w
        elif not ok and start is not None:
            if w - 1 > start:
                runs.append((start, w - 1))
            start = None
    return sorted(runs, key=lambda r: (r[1] - r[0], r[1]), reverse=True)


def hosting_problem(
    cfg: RaytrainConfig, env: Environment, use_gpu: bool, world_size: int
) -> tuple[str, bool] | None:
    """Why the target cannot host ``world_size`` workers, and whether that refuses the run:
    a machine or a SLURM allocation never grows; a Ray cluster may (an autoscaler), and Ray
    then waits for it. None when they fit."""
    devices = available_devices(env, use_gpu, cfg.scaling)
    if world_size <= devices:
        return None
    unit = (
        f"GPUs at {cfg.scaling.gpus_per_worker:g} per worker"
        if use_gpu
        else f"CPUs at {cfg.scaling.cpus_per_worker:g} per worker"
    )
    needs = f"scaling.num_workers={world_size} needs more than the {devices} workers"
    if env.resources.source == "this machine":
        return (
            f"{needs} this machine can host ({unit}); lower scaling.num_workers or pass "
            f"--address of a larger Ray cluster",
            True,
        )
    if env.slurm is not None:
        return (
            f"{needs} this SLURM allocation can host ({unit}); lower scaling.num_workers or "
            f"request more (sbatch --nodes, --gpus-per-node, --cpus-per-task)",
            True,
        )
    return (
        f"scaling.num_workers={world_size} is more than the {devices} workers the cluster can "
        f"host now ({unit}); training starts once the cluster has grown",
        False,
    )


def check_hosting(
    cfg: RaytrainConfig, env: Environment, use_gpu: bool, world_size: int, preview: bool
) -> bool:
    """Whether the workers fit; refuses what never will unless previewing, warns otherwise."""
    problem = hosting_problem(cfg, env, use_gpu, world_size)
    if problem is None:
        return True
    message, refused = problem
    if refused and not preview:
        raise PlanError(message)
    logger.warning("%s", message)
    return False


def workers_fit(
    cfg: RaytrainConfig, env: Environment, use_gpu: bool, world_size: int, preview: bool
) -> bool:
    """Whether the target hosts the run's workers now (``check_hosting``); an elastic run
    needs room for its min workers and grows to max as the cluster allows."""
    elastic = worker_range(cfg)
    if not elastic:
        return check_hosting(cfg, env, use_gpu, world_size, preview)
    check_elastic_range(cfg, *elastic)
    fits = check_hosting(cfg, env, use_gpu, elastic[0], preview)
    if fits and hosting_problem(cfg, env, use_gpu, world_size):
        logger.info(
            "scaling.num_workers=%s: %d workers fit now; the run grows when more do",
            list(elastic),
            available_devices(env, use_gpu, cfg.scaling),
        )
    return fits
