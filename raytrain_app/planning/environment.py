"""Where are we running? The one module that reads the process environment.

Each launcher kind (SLURM, torchrun, plain) has a detector; ``detect_environment`` runs them
in priority order and returns one immutable description. Nothing else in raytrain reads
``SLURM_*``, torchrun variables, ``RAY_ADDRESS``, ``RAYTRAIN_DASHBOARD_HOST`` or probes
devices: it asks this module (``planning.cluster_resources`` asks a connected Ray cluster
what it offers).
"""

from __future__ import annotations

import logging
import os
import platform
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: a job client reads its addresses without torch
    import torch

logger = logging.getLogger(__name__)

# Ray's setting for its worker processes' nice value, as an environment variable (Ray's
# own lower-case name: ray._private.ray_constants.RAY_WORKER_NICENESS).
_RAY_WORKER_NICENESS = "RAY_worker_niceness"

# Ray Train V2 collects reports on a health-check poll (2 s by default), so each report
# can wait that long; a 0.2 s poll keeps reports prompt (its cost: benchmarks/README.md).
_RAY_TRAIN_ENV_DEFAULTS = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    # Without this, every line a worker logs shows up twice on the driver.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}
# Also off on a single-machine Ray that raytrain starts itself, where they only cost start-up
# time (an extra actor process, metric registration in the controller and every worker).
_EMBEDDED_RAY_TRAIN_ENV_DEFAULTS = {
    # Polls for cluster nodes being drained (cloud preemption); a one-machine Ray has none.
    # raytrain's own stop on SIGUSR1/SIGTERM does not depend on it.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # Prometheus metrics for the dashboard's Train view, gone with the embedded Ray.
    "RAY_TRAIN_METRICS_ENABLED": "0",
    # Every worker at nice 0 (Ray's default: 15), as torchrun's are: the training workers
    # inherit it (training_worker_env_vars) and need no runtime env (driver.embedded_ray).
    _RAY_WORKER_NICENESS: "0",
}

# An embedded Ray's dashboard server, where its UI is asked for, also serves Ray's job API
# (it runs code): only this machine reaches it unless the user names another interface.
LOCAL_DASHBOARD_HOST = "127.0.0.1"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU model as seen by torch."""

    name: str
    capability: tuple[int, int]
    memory_gb: float


@dataclass(frozen=True)
class SlurmInfo:
    """The SLURM allocation this process runs in."""

    job_id: str
    num_nodes: int
    ntasks: int
    cpus_per_task: int | None
    gpus_per_node: int | None
    # Each allocated node's CPUs (SLURM_JOB_CPUS_PER_NODE, e.g. "2(x2)" -> (2, 2)).
    cpus_per_node: tuple[int, ...] = ()


@dataclass(frozen=True)
class TorchrunInfo:
    """Variables torchrun (torch.distributed.run) sets for each process."""

    rank: int
    local_rank: int
    world_size: int
    # The processes on this node (LOCAL_WORLD_SIZE), one GPU each when training on GPUs;
    # None: all of them (torchrun sets it; a single node has no other).
    local_world_size: int | None = None


@dataclass(frozen=True)
class Resources:
    """What the target offers: the Ray cluster, the SLURM allocation, or this machine."""

    cpus: float
    gpus: float
    nodes: int
    source: str  # "ray cluster", "SLURM allocation" or "this machine"
    # Each node's CPUs and GPUs where known: a worker cannot span two nodes.
    node_cpus: tuple[float, ...] = ()
    node_gpus: tuple[float, ...] = ()


@dataclass(frozen=True)
class Environment:
    """Everything raytrain needs to know about where it runs."""

    platform: str
    python: str
    torch_version: str
    launcher: str  # "slurm", "torchrun" or "local"
    ray_address: str | None
    resources: Resources  # what the plan is made against
    gpu: GpuInfo | None = None
    slurm: SlurmInfo | None = None
    torchrun: TorchrunInfo | None = None
    # An embedded Ray's dashboard UI, on this interface: ``RAYTRAIN_DASHBOARD_HOST``; None:
    # no UI (its job server on localhost).
    dashboard_host: str | None = None
    # This process started the Ray it uses (``driver.ray_session``): it ends with it.
    embedded_ray: bool = False
    # This machine alone, which a Ray started here gets; None: the same as ``resources``.
    machine: Resources | None = None

    def with_resources(self, resources: Resources, gpu: GpuInfo | None = None) -> Environment:
        """Return a copy with the cluster's resources and the GPU model its workers get
        (None: none, or not known). The driver's own GPU never stands in for the workers':
        a laptop's T4 would plan fp16 without compile for a cluster of H100s."""
        return replace(self, resources=resources, gpu=gpu)


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _gpus_from_slurm(env: Mapping[str, str]) -> int | None:
    # SLURM_GPUS_ON_NODE is the count; SLURM_GPUS_PER_NODE may read "a100:4".
    count = _int_or_none(env.get("SLURM_GPUS_ON_NODE"))
    if count is not None:
        return count
    per_node = env.get("SLURM_GPUS_PER_NODE")
    return _int_or_none(per_node.rsplit(":", 1)[-1]) if per_node else None


def parse_slurm_counts(text: str | None) -> tuple[int, ...]:
    """One count per node from SLURM's compressed form: ``"72(x2),36"`` -> (72, 72, 36);
    () when absent or unreadable."""
    counts: list[int] = []
    for part in (text or "").split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return ()
        counts += [int(match[1])] * int(match[2] or 1)
    return tuple(counts)


def detect_slurm(env: Mapping[str, str]) -> SlurmInfo | None:
    """The SLURM allocation, or None outside SLURM."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    return SlurmInfo(
        job_id=job_id,
        num_nodes=_int_or_none(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")) or 1,
        ntasks=_int_or_none(env.get("SLURM_NTASKS")) or 1,
        cpus_per_task=_int_or_none(env.get("SLURM_CPUS_PER_TASK")),
        gpus_per_node=_gpus_from_slurm(env),
        cpus_per_node=parse_slurm_counts(env.get("SLURM_JOB_CPUS_PER_NODE")),
    )


def allocation_resources(slurm: SlurmInfo, machine: Resources) -> Resources:
    """Every allocated node's CPUs and GPUs: what Ray started on each node of the job
    (the sbatch script) will offer. Without SLURM's per-node counts, each node is assumed
    to hold this node's share: its tasks' CPUs, or this machine's."""
    per_node = slurm.cpus_per_node
    if not per_node:
        tasks_per_node = -(-slurm.ntasks // slurm.num_nodes)
        cpus = slurm.cpus_per_task * tasks_per_node if slurm.cpus_per_task else machine.cpus
        per_node = (int(cpus),) * slurm.num_nodes
    gpus = slurm.gpus_per_node if slurm.gpus_per_node is not None else machine.gpus
    return Resources(
        cpus=float(sum(per_node)),
        gpus=float(gpus * len(per_node)),
        nodes=len(per_node),
        source="SLURM allocation",
        node_cpus=tuple(float(c) for c in per_node),
        node_gpus=(float(gpus),) * len(per_node),
    )


def detect_torchrun(env: Mapping[str, str]) -> TorchrunInfo | None:
    """torchrun's rank variables, or None when not launched by torchrun."""
    if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_RANK" not in env:
        return None
    return TorchrunInfo(
        rank=_int_or_none(env.get("RANK")) or 0,
        local_rank=_int_or_none(env.get("LOCAL_RANK")) or 0,
        world_size=_int_or_none(env.get("WORLD_SIZE")) or 1,
        local_world_size=_int_or_none(env.get("LOCAL_WORLD_SIZE")),
    )


def local_gpu() -> GpuInfo | None:
    """The first local CUDA GPU, or None."""
    import torch  # here, not at the top: a job client reads its addresses without torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return GpuInfo(
        name=props.name,
        capability=(props.major, props.minor),
        memory_gb=round(props.total_memory / 2**30, 1),
    )


def device_gpu_name(device: torch.device) -> str | None:
    """The model name of the GPU a worker trains on (``torch.device``), as torch reports
    it; None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def local_cpus(slurm: SlurmInfo | None) -> int:
    """CPUs this process may use: SLURM's per-task count, else the CPU affinity mask."""
    if slurm and slurm.cpus_per_task:
        return slurm.cpus_per_task
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity API
        return os.cpu_count() or 1


def dashboard_host(env: Mapping[str, str]) -> str | None:
    """The interface an embedded Ray's dashboard UI listens on, where the user asks for the
    UI with ``RAYTRAIN_DASHBOARD_HOST`` (``127.0.0.1``: this machine only); None: no UI.

    Without it an embedded Ray starts without Ray's dashboard process, which ``ray.init()``
    waits for (``driver.embedded_ray``; benchmarks/README.md, "First step").
    """
    return env.get("RAYTRAIN_DASHBOARD_HOST") or None


def cluster_address(env: Mapping[str, str]) -> str | None:
    """The Ray cluster that Ray's own ``RAY_ADDRESS`` names, if any: a run joins it."""
    return env.get("RAY_ADDRESS") or None


def token_auth_without_a_token(env: Mapping[str, str]) -> bool:
    """Whether Ray's token auth is on (its default for a local cluster, ``RAY_AUTH_MODE``)
    and no variable gives a token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``): then
    ``ray.init()`` uses ``~/.ray/auth_token``, or generates one."""
    mode = env.get("RAY_AUTH_MODE", "token").lower()
    return mode == "token" and not (env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH"))


def detect_environment(env: Mapping[str, str] | None = None) -> Environment:
    """Describe this process's environment; ``env`` defaults to ``os.environ``."""
    env = os.environ if env is None else env
    slurm = detect_slurm(env)
    torchrun = detect_torchrun(env)
    gpu = local_gpu()
    import torch  # local_gpu imported it already

    launcher = "slurm" if slurm else "torchrun" if torchrun else "local"
    machine = Resources(
        cpus=float(local_cpus(slurm)),
        gpus=float(torch.cuda.device_count() if gpu else 0),
        nodes=1,
        source="this machine",
    )
    # Inside a SLURM job, plan against the whole allocation: Ray spans all of its nodes.
    resources = allocation_resources(slurm, machine) if slurm else machine
    return Environment(
        platform=f"{platform.system()} {platform.machine()}",
        python=sys.version.split()[0],
        torch_version=torch.__version__,
        launcher=launcher,
        ray_address=cluster_address(env),
        resources=resources,
        gpu=gpu,
        slurm=slurm,
        torchrun=torchrun,
        dashboard_host=dashboard_host(env),
        machine=machine,
    )


def job_server_address(flag: str | None) -> str | None:
    """The Ray job server to talk to: ``--address``, else Ray's own variables."""
    return flag or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")


def enable_client_token_auth() -> bool:
    """Send the Ray auth token with client requests if one is configured; True if so.

    Ray 2.60 clients attach ``Authorization: Bearer`` only when ``RAY_AUTH_MODE=token``;
    the token itself comes from ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``.
    """
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    has_token = bool(
        os.environ.get("RAY_AUTH_TOKEN")
        or (path and os.path.isfile(path))
        or os.path.isfile(os.path.expanduser("~/.ray/auth_token"))
    )
    if has_token:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    return has_token


def apply_ray_train_defaults(embedded: bool = False) -> list[str]:
    """Set Ray Train's tuning variables in this (driver) process unless the user set them.

    Ray Train propagates these from the driver to its controller and workers.

    Args:
        embedded: Ray runs on this machine alone, started here: also turn off what only a
            multi-node cluster uses.

    Returns:
        The names of the variables set (those the user had not set).
    """
    defaults = {**_RAY_TRAIN_ENV_DEFAULTS, **(_EMBEDDED_RAY_TRAIN_ENV_DEFAULTS if embedded else {})}
    if not _writes_to_terminal():
        # The driver prints worker lines behind a "(RayTrainWorker pid=...)" prefix that Ray
        # colours with ANSI codes whatever the output is: a SLURM .out file, a job log or a
        # pipe would hold ESC[36m ... ESC[0m on every line.
        defaults["RAY_COLOR_PREFIX"] = "0"
    added = [name for name in defaults if name not in os.environ]
    for name in added:
        os.environ[name] = defaults[name]
    return added


def _writes_to_terminal() -> bool:
    """Whether both of this process's output streams are a terminal (colour reads there)."""
    streams = (sys.stdout, sys.stderr)
    return all(
        stream is not None and getattr(stream, "isatty", lambda: False)() for stream in streams
    )


def unset_ray_train_defaults(names: list[str]) -> None:
    """Undo ``apply_ray_train_defaults`` for the ``names`` it returned, so that a later
    session in this process (on a cluster, say) starts from the user's own environment."""
    for name in names:
        os.environ.pop(name, None)


@contextmanager
def plain_breakpoints() -> Iterator[None]:
    """``breakpoint()`` runs pdb in this process's terminal while the block runs.

    A process that ever called ``ray.init`` (a notebook, a test session) has
    ``PYTHONBREAKPOINT`` set to Ray's remote debugger, which needs a Ray worker: in Ray
    Train's local mode there is none, and the user's breakpoint would raise instead.
    """
    hook = os.environ.get("PYTHONBREAKPOINT", "")
    rays = hook.startswith("ray.util.rpdb")
    if rays:
        del os.environ["PYTHONBREAKPOINT"]
    try:
        yield
    finally:
        if rays:
            os.environ["PYTHONBREAKPOINT"] = hook


def one_torch_thread_per_process() -> None:
    """Processes this one starts (torchrun's) use one thread each for torch, as Ray gives
    its workers, unless the user set ``OMP_NUM_THREADS`` (torchrun would set the same,
    with a warning)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def training_worker_env_vars() -> dict[str, str]:
    """Environment variables for Ray Train's worker processes.

    Ray starts worker processes at nice 15, below its own daemons and anything else on the
    node; training workers hold their CPUs in Ray's accounting and run at nice 0, as
    torchrun's do (lock-step workers otherwise lose their slices to Ray's daemons; see
    benchmarks/README.md). ``RAY_worker_niceness`` set by the user wins.
    """
    return {_RAY_WORKER_NICENESS: os.environ.get(_RAY_WORKER_NICENESS, "0")}


def variables_set(names: Iterable[str]) -> dict[str, str]:
    """Those of the variables ``names`` that are set in this process, with their values
    (``planning.store_variables`` decides which a run's processes get)."""
    return {name: os.environ[name] for name in names if name in os.environ}
