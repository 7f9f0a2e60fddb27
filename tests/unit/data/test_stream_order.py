"""The streaming order is a pure function of (seed, epoch, chunks, lanes): every world size
that divides the lanes trains the same windows at every global step, each at most once an
epoch, and every lane (so every rank) has the same number of steps."""

from __future__ import annotations

import numpy as np
from stream_data import step_ids

from raytrain_app.data.stream_manifest import ChunkTable
from raytrain_app.data.stream_order import EpochOrder, block_windows, rank_lanes


def _chunks(counts: list[int]) -> ChunkTable:
    """Chunks of the given window counts (series and rows do not matter to the order)."""
    n = len(counts)
    return ChunkTable(
        series=np.arange(n), group=np.zeros(n, int), first=np.zeros(n, int), count=np.array(counts)
    )


# Skewed chunk sizes, as series ends and the validation cut make them.
CHUNKS = _chunks([4096, 17, 1, 900, 4096, 4096, 333, 2, 2048, 5000, 64])


def test_a_global_step_holds_the_same_windows_for_every_world_size():
    order = EpochOrder(CHUNKS, lanes=8, per_lane_step=4, seed=7, epoch=1)
    for step in (0, 1, order.steps // 2, order.steps - 1):
        whole = step_ids(order, step, range(8))
        for world_size in (1, 2, 4, 8):
            ranks = [step_ids(order, step, rank_lanes(8, r, world_size)) for r in range(world_size)]
            assert all(len(ids) == 32 // world_size for ids in ranks)  # the same share each
            assert sorted(np.concatenate(ranks).tolist()) == sorted(whole.tolist())


def test_an_epoch_trains_each_window_at_most_once_and_drops_less_than_a_lane_remainder():
    order = EpochOrder(CHUNKS, lanes=8, per_lane_step=4, seed=7, epoch=0)
    seen = np.concatenate([step_ids(order, k, range(8)) for k in range(order.steps)])
    assert len(seen) == len(set(seen.tolist())) == order.steps * 32
    assert CHUNKS.num_windows - len(seen) < 8 * 4 + 8  # lane remainders only
    assert seen.min() >= 0 and seen.max() < CHUNKS.num_windows


def test_the_order_is_a_pure_function_of_seed_and_epoch():
    def ids(seed: int, epoch: int) -> list[int]:
        order = EpochOrder(CHUNKS, lanes=8, per_lane_step=4, seed=seed, epoch=epoch)
        return np.concatenate([step_ids(order, k, range(8)) for k in range(5)]).tolist()

    assert ids(7, 0) == ids(7, 0)
    assert ids(7, 0) != ids(7, 1)
    assert ids(7, 0) != ids(8, 0)


def test_a_step_of_a_lane_lies_in_one_block_and_blocks_shuffle_windows():
    order = EpochOrder(CHUNKS, lanes=2, per_lane_step=3, seed=1, epoch=0)
    assert order.block == block_windows(3) and order.block % 3 == 0
    for step in range(order.steps):
        part = order.step_slice(step)
        assert part.start >= 0 and part.stop <= order.block
    positions = order.block_positions(lane=0, block=0)
    assert sorted(positions.tolist()) == list(range(len(positions)))  # a permutation
    assert positions.tolist() != sorted(positions.tolist())  # not the file order


def test_resuming_at_a_step_needs_only_that_steps_block():
    """Step k's windows come from block k * s // block of each lane: a resume reads that
    block and nothing before it."""
    order = EpochOrder(CHUNKS, lanes=4, per_lane_step=2, seed=3, epoch=2)
    step = order.steps - 3
    block = order.block_of_step(step)
    for lane in range(4):
        ids = order.sequence_ids(order.block_positions(lane, block)[order.step_slice(step)])
        assert ids.tolist() == step_ids(order, step, [lane]).tolist()
