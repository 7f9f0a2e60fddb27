"""A rank's batches of streaming data: its lanes' windows step by step, validation once.

The order is ``data.stream_order``'s (the same global steps for every world size dividing
the lane count); this module reads it with bounded memory: each lane holds the block it is
in and the next one, read by background threads (pyarrow reads release the GIL) while the
current block trains. A resume at step ``k`` reads the blocks holding ``k`` and nothing
before. Validation gives rank ``r`` the ``r``-th of W contiguous shares of the validation
windows, read chunk by chunk: every window counts once for any number of workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from raytrain_app.data.stream_order import (
    BLOCK_ROWS,
    EpochOrder,
    allowed_world_sizes,
    lane_count,
    rank_lanes,
    stream_steps_per_epoch,
)
from raytrain_app.data.stream_reader import (
    PreparedFiles,
    WindowBlock,
    lane_positions,
    merge_blocks,
    read_windows,
    window_batches,
)
from raytrain_app.planning.rules import TrainingPlan

# Threads reading row groups ahead of training: enough to overlap a read per lane of a
# rank with the step, few enough to leave the cores to the model.
_READ_THREADS = 2


def read_ahead_bytes(
    rows_per_group: int, window: int, num_columns: int, lanes_per_rank: int
) -> int:
    """About the most a rank holds of streaming data (series longer than a row group;
    many shorter ones add a window's rows per series a block touches): per lane, the block
    it trains on and the next, each its windows' rows plus a whole row group at either
    end, in float32; and a row group in float64 per read in flight."""
    group_rows = rows_per_group + window - 1
    block_rows = BLOCK_ROWS + 2 * group_rows
    lanes = lanes_per_rank * 2 * block_rows * num_columns * 4
    return lanes + _READ_THREADS * group_rows * num_columns * 8


class StreamBatches:
    """The loaders of one rank over prepared data (the interface of ``WorkerLoaders``)."""

    # Tests set this to a list to collect (epoch, step, this rank's window ids) per step.
    record_ids: list[tuple[int, int, np.ndarray]] | None = None

    def __init__(
        self,
        files: PreparedFiles,
        plan: TrainingPlan,
        *,
        seed: int,
        rank: int,
        world_size: int,
        prepare: Callable[[Any], Any],
    ) -> None:
        self.files, self.plan, self.seed = files, plan, seed
        self.rank, self.world_size = rank, world_size
        global_batch = plan.effective_batch_size
        allowed = allowed_world_sizes(global_batch, world_size, plan.worker_range)
        self.lanes = lane_count(global_batch, allowed)
        self.per_lane_step = global_batch // self.lanes
        self.my_lanes = rank_lanes(self.lanes, rank, world_size)
        self.train_samples = files.manifest.chunks("train").num_windows
        self.val_samples = files.manifest.chunks("val").num_windows
        self.steps_per_epoch = stream_steps_per_epoch(files.manifest, plan)
        self._prepare = prepare
        self._pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="raytrain-stream")
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

    def read_block(self, order: EpochOrder, lane: int, block: int) -> Future[WindowBlock]:
        positions = order.block_positions(lane, block)
        return self._pool.submit(read_windows, self.files, "train", order.sequence_ids(positions))

    def shut_down(self) -> None:
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
        held: dict[tuple[int, int], Future[WindowBlock]] = {}
        merged: tuple[int, WindowBlock] | None = None  # the block all lanes are in, merged
        for step in range(self.first_step, order.steps):
            block = order.block_of_step(step)
            for lane in stream.my_lanes:
                for wanted in (block, block + 1):  # this block, and the next one read ahead
                    if (lane, wanted) not in held and wanted * order.block < order.lane_length:
                        held[(lane, wanted)] = stream.read_block(order, lane, wanted)
                held.pop((lane, block - 1), None)
            if merged is None or merged[0] != block:
                # Once per block: every step of it then takes all its windows in one gather.
                merged = (block, merge_blocks([held[(n, block)].result() for n in stream.my_lanes]))
            current = merged[1]
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
