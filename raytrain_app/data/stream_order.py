"""The order streaming windows train in: a pure function of (seed, epoch, manifest, lanes).

The training windows form C canonical lanes (C divides the global batch; every allowed
world size divides C). Each epoch a seeded permutation of the chunks lays their windows
end to end; lane ``l`` is the ``l``-th of C equal consecutive segments of that sequence, its
windows shuffled within blocks of ``block`` positions. Global step ``k`` takes positions
``[k * s, (k + 1) * s)`` of every lane (``s = global batch / C``) and rank ``r`` of ``W``
owns lanes ``r, r + W, ...``. So:

- a global step holds the same windows for every world size dividing C;
- a resume needs only (epoch, step) and reads one block per lane to get there;
- every lane has the same length, so every rank runs the same number of steps.

Against a uniform permutation of all windows this gives up: a step's windows come from C
segments of a few consecutive chunks each (a chunk: the windows of one series starting in
one row group), and windows stay near the others of their block. Up to ``C * s - 1``
windows of an epoch (the lanes' remainders) are left out, as ``drop_last`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from raytrain_app.data.stream_manifest import ChunkTable, StreamManifest
from raytrain_app.errors import BadInputError

# Most lanes: each is one block of windows held (and one prefetched) per rank that owns
# it, so lanes bound a rank's memory; 256 lets a run grow to 256 workers.
MAX_LANES = 256
# Rows whose windows a lane shuffles together (one row group's worth): with the next block
# read ahead, a rank holds about 2 * (BLOCK_ROWS + a row group) rows per lane it reads.
BLOCK_ROWS = 4096


def lane_count(global_batch: int, world_sizes: tuple[int, ...]) -> int:
    """C: the largest divisor of the global batch up to ``MAX_LANES``. A function of the
    batch alone, so that a resume at another world size keeps the order; every world size
    the run may take must divide it."""
    lanes = next(d for d in range(min(global_batch, MAX_LANES), 0, -1) if global_batch % d == 0)
    misfits = [size for size in world_sizes if lanes % size]
    if misfits:
        fitting = [d for d in range(1, lanes + 1) if lanes % d == 0]
        raise BadInputError(
            f"Streaming data splits train.global_batch_size={global_batch} into {lanes} lanes, "
            f"which {', '.join(map(str, misfits))} worker(s) cannot share equally; set "
            f"scaling.num_workers to one of {', '.join(map(str, fitting))} or choose a global "
            f"batch with more factors of two."
        )
    return lanes


def allowed_world_sizes(
    global_batch: int, world_size: int, worker_range: tuple[int, int] | None
) -> tuple[int, ...]:
    """The world sizes a run may train at: its own, and those of its elastic range that
    split the global batch."""
    sizes = range(worker_range[0], worker_range[1] + 1) if worker_range else ()
    return tuple(sorted(s for s in {*sizes, world_size} if global_batch % s == 0))


def stream_steps_per_epoch(manifest: StreamManifest, plan: Any) -> int:
    """Optimizer steps per epoch of ``manifest``'s training windows under ``plan`` (a
    ``TrainingPlan``); refuses data too small for one step."""
    batch = plan.effective_batch_size
    lanes = lane_count(batch, allowed_world_sizes(batch, plan.world_size, plan.worker_range))
    windows = manifest.chunks("train").num_windows
    steps = windows // lanes // (batch // lanes)
    if steps < 1:
        raise BadInputError(
            f"the streaming training data has {windows} windows, too few for one step of "
            f"train.global_batch_size={batch} over {lanes} lanes (each needs "
            f"{batch // lanes}); lower train.global_batch_size or use more data"
        )
    return steps


def block_windows(per_lane_step: int, stride: int = 1) -> int:
    """Positions a lane shuffles together: windows starting within about ``BLOCK_ROWS``
    rows, so that a block's memory does not grow with the stride, and a multiple of a
    step's positions, so that a step's windows of one lane lie in one block."""
    return per_lane_step * max(1, BLOCK_ROWS // stride // per_lane_step)


@dataclass(frozen=True)
class EpochOrder:
    """Where every lane position of one epoch comes from."""

    chunks: ChunkTable
    lanes: int
    per_lane_step: int
    seed: int
    epoch: int
    stride: int = 1

    @property
    def lane_length(self) -> int:
        return self.chunks.num_windows // self.lanes

    @property
    def steps(self) -> int:
        return self.lane_length // self.per_lane_step

    @property
    def block(self) -> int:
        return block_windows(self.per_lane_step, self.stride)

    @cached_property
    def _permutation(self) -> np.ndarray:
        """The chunks in this epoch's order, and where each one's windows begin in it."""
        rng = np.random.default_rng([self.seed, self.epoch])
        return rng.permutation(len(self.chunks))

    @cached_property
    def _starts(self) -> np.ndarray:
        counts = self.chunks.count[self._permutation]
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def sequence_ids(self, positions: np.ndarray) -> np.ndarray:
        """The window ids (indices among the split's windows) at ``positions`` of the
        epoch's chunk sequence."""
        slot = np.searchsorted(self._starts, positions, side="right") - 1
        chunk = self._permutation[slot]
        return self.chunks.offsets[chunk] + (positions - self._starts[slot])

    def block_positions(self, lane: int, block: int) -> np.ndarray:
        """The sequence positions of lane ``lane``'s block ``block``, in training order."""
        begin = block * self.block
        end = min(begin + self.block, self.lane_length)
        rng = np.random.default_rng([self.seed, self.epoch, lane, block])
        return lane * self.lane_length + begin + rng.permutation(end - begin)

    def block_of_step(self, step: int) -> int:
        return step * self.per_lane_step // self.block

    def step_slice(self, step: int) -> slice:
        """The positions of ``step`` inside its block (the same for every lane)."""
        begin = step * self.per_lane_step - self.block_of_step(step) * self.block
        return slice(begin, begin + self.per_lane_step)

    def step_ids(self, step: int, lanes: range | list[int]) -> np.ndarray:
        """The window ids ``step`` takes from ``lanes``, lane after lane (for tests and
        for checking; the reader takes them from blocks it already holds)."""
        block, part = self.block_of_step(step), self.step_slice(step)
        return np.concatenate(
            [self.sequence_ids(self.block_positions(lane, block)[part]) for lane in lanes]
        )


def rank_lanes(lanes: int, rank: int, world_size: int) -> range:
    """The lanes rank ``rank`` of ``world_size`` reads."""
    return range(rank, lanes, world_size)
