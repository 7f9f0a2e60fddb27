"""Environments to plan against in tests: explicit machines, never the host's own."""

from __future__ import annotations

from raytrain_app.planning.environment import Environment, GpuInfo, Resources

H100 = GpuInfo("NVIDIA H100 80GB HBM3", (9, 0), 79.2)
A100 = GpuInfo("NVIDIA A100", (8, 0), 80.0)
V100 = GpuInfo("Tesla V100", (7, 0), 32.0)
T4 = GpuInfo("Tesla T4", (7, 5), 15.0)
P100 = GpuInfo("Tesla P100", (6, 0), 16.0)


def make_env(
    cpus: float = 2,
    gpus: float = 0,
    gpu: GpuInfo | None = None,
    source: str = "this machine",
    node_gpus: tuple[float, ...] = (),
) -> Environment:
    """``node_gpus``: each node's GPUs (their sum is ``gpus``), for a cluster of several."""
    nodes = max(len(node_gpus), 1)
    return Environment(
        platform="Linux x86_64",
        python="3.11",
        torch_version="2.13",
        launcher="local",
        ray_address=None,
        resources=Resources(cpus=cpus, gpus=gpus, nodes=nodes, source=source, node_gpus=node_gpus),
        gpu=gpu,
    )
