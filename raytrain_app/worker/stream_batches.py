"""A rank's batches of streaming data: its lanes' windows step by step, validation once.

The order is ``data.stream_order``'s (the same global steps for every world size dividing
the lane count); this module reads it with bounded memory. The rank reads its lanes'
blocks of one block index together, as one ``PendingBlock``: a row group that several of
its lanes need is read once. It holds two such blocks: the one it trains on and the next,
read by background threads (pyarrow reads release the GIL) while the current one trains;
the next one copies the row groups the current one already holds. The order is a pure
function of (seed, epoch, manifest), so the block after an epoch's last is the next
epoch's first: it is read ahead while the epoch ends (and through validation), not when
the next epoch starts. A resume at step ``k`` reads the blocks holding ``k`` and nothing
before. Validation gives rank ``r`` the ``r``-th of W contiguous shares of the validation
windows, read chunk by chunk: every window counts once for any number of workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from raytrain_app.data.stream_order import (
    BLOCK_ROWS,
    EpochOrder,
    rank_lanes,
    stream_steps_per_epoch,
)
from raytrain_app.data.stream_reader import (
    PendingBlock,
    PreparedFiles,
    WindowBlock,
    lane_positions,
    window_batches,
)
from raytrain_app.planning.lanes import run_lanes
from raytrain_app.planning.rules import TrainingPlan

# Threads reading row groups ahead of training: two reads in flight hide the store's
# latency, and leave the cores to the model.
_READ_THREADS = 2


def read_ahead_bytes(
    rows_per_group: int, window: int, num_columns: int, lanes_per_rank: int
) -> int:
    """About the most a rank holds of streaming data (series longer than a row group;
    many shorter ones add a window's rows per series a block touches): per lane, the block
    it trains on and the next (the next epoch's first, at an epoch's end); while it
    validates, the next epoch's first block and two spans of validation windows. A lane's
    block or a span is its windows' rows plus a whole row group at either end, in float32
    (a rank's block holds at most the sum of its lanes': shared row groups are held once).
    Plus a row group in float64 per read in flight."""
    group_rows = rows_per_group + window - 1
    block_rows = BLOCK_ROWS + 2 * group_rows
    blocks = max(2 * lanes_per_rank, lanes_per_rank + 2)
    return blocks * block_rows * num_columns * 4 + _READ_THREADS * group_rows * num_columns * 8


class StreamBatches:
    """The loaders of one rank over prepared data (the interface of ``WorkerLoaders``)."""

    # Tests set this to a list to collect (epoch, step, this rank's window ids) per step.
    record_ids: list[tuple[int, int, np.ndarray]] | None = None
    # Whether the block read next copies the row groups the current one holds rather than
    # reading them again (data within two blocks is then read from the store once). The
    # streaming benchmark clears it to time every block read from the store, as it is when
    # the data is much larger than a block.
    copy_held: bool = True

    def __init__(
        self,
        files: PreparedFiles,
        plan: TrainingPlan,
        *,
        seed: int,
        rank: int,
        world_size: int,
        prepare: Callable[[Any], Any],
        lanes: int | None = None,
    ) -> None:
        """``lanes``: the run's lane count as the driver chose it (a resume: the one its
        checkpoints record); None: chosen here, from the plan."""
        self.files, self.plan, self.seed = files, plan, seed
        self.rank, self.world_size = rank, world_size
        global_batch = plan.effective_batch_size
        self.lanes = run_lanes(global_batch, world_size, plan.worker_range, recorded=lanes)
        self.per_lane_step = global_batch // self.lanes
        self.my_lanes = rank_lanes(self.lanes, rank, world_size)
        self.train_samples = files.manifest.chunks("train").num_windows
        self.val_samples = files.manifest.chunks("val").num_windows
        self.steps_per_epoch = stream_steps_per_epoch(files.manifest, global_batch, self.lanes)
        self._prepare = prepare
        self._pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="raytrain-stream")
        # The block read ahead, keyed (epoch, block): it outlives an epoch's iterator, so
        # the next epoch's first block is read while this epoch ends.
        self._ahead: tuple[tuple[int, int], PendingBlock] | None = None
        self.val = prepare(_ValidationBatches(self))

    def _order(self, epoch: int) -> EpochOrder:
        chunks = self.files.manifest.chunks("train")
        stride = self.files.manifest.stride
        return EpochOrder(chunks, self.lanes, self.per_lane_step, self.seed, epoch, stride)

    def epoch_batches(self, epoch: int, skip_samples: int = 0) -> Iterator[Any]:
        """This rank's micro-batches of ``epoch`` from the step that ``skip_samples`` (this
        rank's samples already trained in the epoch) reaches."""
        share = self.plan.effective_batch_size // self.world_size
        if skip_samples % share:
            raise ValueError(f"skip_samples={skip_samples} is not a whole number of steps")
        return iter(self._prepare(_EpochBatches(self, epoch, skip_samples // share)))

    def take_block(self, order: EpochOrder, block: int) -> WindowBlock:
        """Block ``block`` of ``order`` for all this rank's lanes, lane after lane (waits
        for it unless it was read ahead); starts reading the block that follows it."""
        key = (order.epoch, block)
        if self._ahead is not None and self._ahead[0] == key:
            pending = self._ahead[1]
        else:  # a first epoch, or a resume: what was read ahead is not what trains next
            self._drop_ahead()
            pending = self._start(order, block, held=None)
        self._ahead = None
        current = pending.result()
        following = self._following(order, block)
        self._ahead = (
            (following[0].epoch, following[1]),
            self._start(*following, held=current if self.copy_held else None),
        )
        return current

    def _following(self, order: EpochOrder, block: int) -> tuple[EpochOrder, int]:
        """The block trained after ``block``: the next one of the epoch, or after the
        epoch's last (the one its last step is in) the next epoch's first. After the
        run's last epoch that read is wasted: one block, inside the bound."""
        if block < order.block_of_step(order.steps - 1):
            return order, block + 1
        return self._order(order.epoch + 1), 0

    def _start(self, order: EpochOrder, block: int, held: WindowBlock | None) -> PendingBlock:
        ids = order.block_ids(block, self.my_lanes)
        return PendingBlock(self.files, "train", ids, self._pool, held)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None

    def shut_down(self) -> None:
        self._drop_ahead()
        self._pool.shutdown(wait=True, cancel_futures=True)


class _EpochBatches:
    """One epoch's micro-batches of one rank, from ``first_step``; iterable once."""

    def __init__(self, stream: StreamBatches, epoch: int, first_step: int) -> None:
        self.stream, self.epoch, self.first_step = stream, epoch, first_step
        self.order = stream._order(epoch)

    def __len__(self) -> int:
        return (self.order.steps - self.first_step) * self.stream.plan.grad_accum_steps

    def __iter__(self) -> Iterator[list]:
        stream, order = self.stream, self.order
        micro, lanes = stream.plan.per_worker_batch_size, len(stream.my_lanes)
        block, current = -1, None
        for step in range(self.first_step, order.steps):
            if order.block_of_step(step) != block:
                block = order.block_of_step(step)
                # Let the block it leaves go first: the rank then holds two blocks at most,
                # this one and the next, read ahead from here.
                current = None
                current = stream.take_block(order, block)
            # A block holds its lanes' windows lane after lane: one gather takes the
            # step's windows of every lane.
            at = lane_positions(lanes, len(current.ids) // lanes, order.step_slice(step))
            if stream.record_ids is not None:
                stream.record_ids.append((self.epoch, step, current.ids[at]))
            x, y = current.gather(at)
            for begin in range(0, len(x), micro):
                yield [x[begin : begin + micro], y[begin : begin + micro]]


class _ValidationBatches:
    """Rank ``r``'s contiguous share of the validation windows, in batches."""

    def __init__(self, stream: StreamBatches) -> None:
        self.stream = stream
        total, size = stream.val_samples, stream.world_size
        self.begin = total * stream.rank // size
        self.end = total * (stream.rank + 1) // size
        plan = stream.plan
        batch = plan.per_worker_batch_size * plan.grad_accum_steps
        if plan.max_batch_per_worker is not None:
            batch = min(batch, plan.max_batch_per_worker)
        self.batch = max(1, batch)

    def __len__(self) -> int:
        return -(-(self.end - self.begin) // self.batch)

    def __iter__(self) -> Iterator[list]:
        stream = self.stream
        return window_batches(
            stream.files, "val", self.batch, stream._pool, begin=self.begin, end=self.end
        )
