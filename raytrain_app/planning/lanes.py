"""How many lanes a streaming run's order has (``data.stream_order``).

Streaming data lays each epoch's windows out in C lanes; a global step takes the same
number from every lane, and rank r of W reads lanes r, r + W, ... So C divides the global
batch, every world size the run may take divides C, and C is at most ``MAX_LANES`` (a rank
holds a block of memory per lane it reads). The order depends on C, so a run keeps the C
its first start chose: its checkpoints record it, and a resume at another world size
continues that order or is refused in one line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from raytrain_app.planning.batch import PlanError, largest_divisor_at_most

# Most lanes: each is one block of windows held (and one prefetched) per rank that owns
# it, so lanes bound a rank's memory; 256 lets a run grow to 256 workers.
MAX_LANES = 256
# meta.json's key for a streaming run's C: every checkpoint records it.
STREAM_LANES_KEY = "stream_lanes"
# World sizes clusters commonly have: up to 32 nodes of 1, 2, 4 or 8 GPUs (3 x 4 = 12,
# 3 x 8 = 24, 6 x 8 = 48 ...).
COMMON_SIZES = frozenset(nodes * gpus for nodes in range(1, 33) for gpus in (1, 2, 4, 8))


def allowed_world_sizes(
    global_batch: int, world_size: int, worker_range: tuple[int, int] | None
) -> tuple[int, ...]:
    """The world sizes a run may train at: its own, and those of its elastic range that
    split the global batch."""
    sizes = range(worker_range[0], worker_range[1] + 1) if worker_range else ()
    return tuple(sorted(s for s in {*sizes, world_size} if global_batch % s == 0))


def lcm_at_most(values: Iterable[int], limit: int) -> int | None:
    """The least common multiple of ``values``, or None once it exceeds ``limit``: that of
    1..100000 has 43 000 digits, slow to compute and too long to print."""
    lcm = 1
    for value in values:
        lcm = math.lcm(lcm, value)
        if lcm > limit:
            return None
    return lcm


def choose_lanes(global_batch: int, world_sizes: Iterable[int]) -> int | None:
    """C for a run that may train at every size of ``world_sizes``; None if none exists.

    C divides the global batch, is a multiple of every size and at most ``MAX_LANES``.
    Among those it is the one the most of ``COMMON_SIZES`` divide: a resume at another
    world size must divide the C the checkpoints record, so a C that more cluster shapes
    divide lets more of them resume (1536 gets 192, which 12, 24 and 48 divide, not 256).
    Then the largest: a step's windows come from C places of the data. A batch of at
    most 256 gets C = the batch, as before lanes were chosen this way.
    """
    step = lcm_at_most(world_sizes, MAX_LANES)
    if step is None:
        return None
    top = min(global_batch, MAX_LANES)
    fits = [c for c in range(step, top + 1, step) if global_batch % c == 0]
    if not fits:
        return None
    return max(fits, key=lambda c: (sum(c % size == 0 for size in COMMON_SIZES), c))


def legacy_lanes(global_batch: int) -> int:
    """C of a checkpoint that records none (raytrain before lanes were chosen from the
    world sizes): the largest divisor of the batch up to ``MAX_LANES``."""
    return largest_divisor_at_most(global_batch, MAX_LANES)


def run_lanes(
    global_batch: int,
    world_size: int,
    worker_range: tuple[int, int] | None,
    recorded: int | None = None,
) -> int:
    """C for a run at ``world_size`` (elastic: ``worker_range``): the ``recorded`` C of its
    checkpoints when it resumes, else ``choose_lanes``'s.

    Raises:
        PlanError: no C serves the run's world sizes, or they cannot share ``recorded``
            (one line naming a scaling.num_workers that works).
    """
    sizes = allowed_world_sizes(global_batch, world_size, worker_range)
    asked = f"scaling.num_workers={list(worker_range) if worker_range else world_size}"
    if recorded is not None:
        misfits = [size for size in sizes if recorded % size]
        if misfits:
            fitting = [d for d in range(1, recorded + 1) if recorded % d == 0]
            raise PlanError(
                f"this run's checkpoints stream its data over {recorded} lanes, which "
                f"{', '.join(map(str, misfits))} worker(s) of {asked} cannot share equally; "
                f"resume with scaling.num_workers set to one of {', '.join(map(str, fitting))}, "
                f"or set a new experiment.name to start over"
            )
        return recorded
    lanes = choose_lanes(global_batch, sizes)
    if lanes is None:
        raise PlanError(
            f"streaming data needs a lane count of at most {MAX_LANES} that divides "
            f"train.global_batch_size={global_batch} and that every world size of {asked} "
            f"divides, and none does; set scaling.num_workers="
            f"{_working_size(global_batch, sizes)}"
        )
    return lanes


def _working_size(global_batch: int, sizes: tuple[int, ...]) -> str:
    """The widest run of consecutive ``sizes`` (then the largest) that some C serves, as
    scaling.num_workers takes it: ``[low, high]``, or one size."""
    best = (0, 0, 0)  # width, high, low
    for i, low in enumerate(sizes):
        for high in sizes[i:]:
            span = [s for s in sizes if low <= s <= high]
            if len(span) != high - low + 1 or choose_lanes(global_batch, span) is None:
                break
            best = max(best, (high - low, high, low))
    if best[1] == 0:  # no size of the run is served: the most workers any C serves
        return str(legacy_lanes(global_batch))
    width, high, low = best
    return f"[{low}, {high}]" if width else str(high)
