"""What a connected Ray cluster offers: its CPUs and GPUs per node, and its workers' GPU.

A plan made against a cluster uses these instead of this machine's (``planning.environment``):
the driver may sit on a CPU-only head node, or on a laptop with a GPU of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from raytrain_app.planning.environment import GpuInfo, Resources, local_gpu

logger = logging.getLogger(__name__)

# Ray's resource name for a node's GPU model ("accelerator_type:A100"), set where Ray
# detects one (ray._common.utils.RESOURCE_CONSTRAINT_PREFIX).
_ACCELERATOR_TYPE = "accelerator_type:"
# How long the GPU query may wait for room on a GPU node (a cluster busy with other runs).
_GPU_QUERY_TIMEOUT_S = 120


def ray_cluster_resources() -> tuple[Resources, GpuInfo | None]:
    """Resources of the connected Ray cluster and the GPU model its workers train on.

    The driver may sit on a CPU-only head node or on a laptop with a GPU of its own: the
    workers' GPU is read on a GPU node, unless this node is the only one with GPUs.
    """
    import ray

    total = ray.cluster_resources()
    alive = [node for node in ray.nodes() if node.get("Alive")]
    resources = Resources(
        cpus=float(total.get("CPU", 0)),
        gpus=float(total.get("GPU", 0)),
        nodes=len(alive),
        source="ray cluster",
        node_cpus=tuple(float(node["Resources"].get("CPU", 0)) for node in alive),
        node_gpus=tuple(float(node["Resources"].get("GPU", 0)) for node in alive),
    )
    gpu_nodes = [node for node in alive if node["Resources"].get("GPU", 0) > 0]
    if not gpu_nodes:
        return resources, None
    if _only_this_node(gpu_nodes):
        return resources, local_gpu()
    return resources, workers_gpu(gpu_nodes, _gpu_on_a_node)


def through_ray_client() -> bool:
    """Whether this process reaches its Ray through Ray Client (a ``ray://`` address): its
    driver then runs on the head node, not on this machine."""
    import ray

    return ray.util.client.ray.is_connected()


def _only_this_node(nodes: list[dict]) -> bool:
    """Whether ``nodes`` is just the node this driver runs on (not through Ray Client)."""
    import ray

    if through_ray_client():
        return False
    here = ray.get_runtime_context().get_node_id()
    return [node["NodeID"] for node in nodes] == [here]


def workers_gpu(
    gpu_nodes: list[dict], ask: Callable[[dict[str, float]], GpuInfo | None]
) -> GpuInfo | None:
    """The GPU model to plan for: of every model among ``gpu_nodes`` (Ray's node entries)
    the least capable, since precision and compile must suit every worker.

    ``ask(resources)`` reads the GPU of a node that offers ``resources``; one call per
    model Ray names on the nodes (one call, any GPU node, where it names none).
    """
    models = sorted(
        {
            key
            for node in gpu_nodes
            for key in node["Resources"]
            if key.startswith(_ACCELERATOR_TYPE)
        }
    )
    found = [ask({model: 0.001}) for model in models] if models else [ask({})]
    known = [gpu for gpu in found if gpu is not None]
    return min(known, key=lambda gpu: (gpu.capability, gpu.memory_gb), default=None)


def _gpu_on_a_node(resources: dict[str, float]) -> GpuInfo | None:
    """``local_gpu`` run as a Ray task on a GPU node offering ``resources``; None, with a
    warning, when no GPU has room for it in time."""
    import ray

    # A sliver of a GPU: placed beside fractional trials too, and Ray sets the task's
    # CUDA_VISIBLE_DEVICES to that GPU.
    task = ray.remote(num_gpus=0.01, num_cpus=0, resources=resources)(local_gpu)
    ref = task.remote()
    try:
        return ray.get(ref, timeout=_GPU_QUERY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        logger.warning(
            "no GPU of the cluster was free within %d s to read its model: precision and "
            "compile are planned as for an unknown GPU (fp32, no compile); set precision and "
            "optimizations.compile to choose them",
            _GPU_QUERY_TIMEOUT_S,
        )
        return None
