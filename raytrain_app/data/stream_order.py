"""The order streaming windows train in: a pure function of (seed, epoch, manifest, lanes).

The training windows form C canonical lanes (C divides the global batch, and every world
size the run may take divides C: ``planning.lanes`` chooses it). Each epoch a seeded
permutation of the chunks lays their windows end to end; lane ``l`` is the ``l``-th of C
equal consecutive segments of that sequence, its windows shuffled within blocks of
``block`` positions. Global step ``k`` takes positions
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

import numpy as np

from raytrain_app.data.stream_manifest import ChunkTable, StreamManifest
from raytrain_app.errors import BadInputError

# Rows whose windows a lane shuffles together (one row group's worth): with the next block
# read ahead, a rank holds about 2 * (BLOCK_ROWS + a row group) rows per lane it reads.
BLOCK_ROWS = 4096


def stream_steps_per_epoch(manifest: StreamManifest, global_batch: int, lanes: int) -> int:
    """Optimizer steps per epoch of ``manifest``'s training windows in ``lanes`` lanes
    (``planning.lanes``); refuses data too small for one step."""
    windows = manifest.chunks("train").num_windows
    steps = windows // lanes // (global_batch // lanes)
    if steps < 1:
        raise BadInputError(
            f"the streaming training data has {windows} windows, too few for one step of "
            f"train.global_batch_size={global_batch} over {lanes} lanes (each needs "
            f"{global_batch // lanes}); lower train.global_batch_size or use more data"
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

    def block_ids(self, block: int, lanes: range | list[int]) -> np.ndarray:
        """The window ids of block ``block`` of ``lanes``, lane after lane, in training
        order: what a rank reading ``lanes`` holds of that block."""
        return np.concatenate(
            [self.sequence_ids(self.block_positions(lane, block)) for lane in lanes]
        )


def rank_lanes(lanes: int, rank: int, world_size: int) -> range:
    """The lanes rank ``rank`` of ``world_size`` reads."""
    return range(rank, lanes, world_size)
