"""Before training on several nodes: is the run directory the same directory on all of them?

A local ``experiment.output_dir`` works on a cluster only if every node that may host a
worker mounts it (a shared filesystem). Otherwise each node would write its own copy:
checkpoints on one node, a resume on another that finds none. The driver writes a marker
next to the run directory, and a zero-CPU task on every node looks for it, within seconds
and before anything of the run is written.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_app.errors import BadInputError, RunFailedError

# How long the nodes get to answer; a node that does not answer cannot host workers either.
_ANSWER_TIMEOUT_S = 60


def _sees(marker: str, token: str) -> bool:
    """On one node: whether ``marker`` exists there and holds ``token``."""
    try:
        return Path(marker).read_text() == token
    except OSError:
        return False


def worker_nodes() -> list[dict]:
    """The alive nodes that can host a training worker (they offer CPUs or GPUs)."""
    return [
        node
        for node in ray.nodes()
        if node.get("Alive")
        and (node["Resources"].get("CPU", 0) > 0 or node["Resources"].get("GPU", 0) > 0)
    ]


def check_shared(output_dir: Path, shown: str) -> None:
    """Raise a one-line BadInputError unless every worker node sees ``output_dir`` as the
    driver does. ``shown`` is the directory as the user wrote it. One node: nothing to do.

    Raises:
        BadInputError: a node does not see the marker (its own local disk is there).
    """
    nodes = worker_nodes()
    if len(nodes) < 2:
        return
    created = [d for d in (output_dir, *output_dir.parents) if not d.exists()]  # deepest first
    output_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    marker = output_dir / f".raytrain-shared-check-{token}"
    marker.write_text(token)
    try:
        look = ray.remote(num_cpus=0)(_sees)
        answers = [
            look.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote(str(marker), token)
            for node in nodes
        ]
        seen = ray.get(answers, timeout=_ANSWER_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RunFailedError(
            f"not every node answered within {_ANSWER_TIMEOUT_S} s whether it sees "
            f"experiment.output_dir '{shown}'; check the cluster's nodes (ray status)"
        ) from None
    finally:
        marker.unlink(missing_ok=True)
        for directory in created:  # leave nothing behind for input that is refused
            directory.rmdir()
    blind = [node["NodeManagerAddress"] for node, ok in zip(nodes, seen, strict=True) if not ok]
    if blind:
        raise BadInputError(
            f"experiment.output_dir '{shown}' is not shared with node {blind[0]}; use a path "
            f"on a shared filesystem or an object-store URI such as s3://bucket/runs"
        )
