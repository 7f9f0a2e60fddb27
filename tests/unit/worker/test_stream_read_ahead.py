"""What a rank of streaming data reads ahead, and that reading ahead changes no sample.

Two series (50 000 rows, stride 1) on one rank, over 4 lanes (each epoch a few blocks, a
block's row group often the next one's too) and over 64 lanes (one block an epoch, each
row group needed by several lanes, as in the streaming benchmark). The rank
- trains every step on the windows ``EpochOrder`` names, with the very values a plain read
  of those windows gives, whether their row groups were read or copied from the block
  before;
- reads a row group once per block, however many of its lanes need it, and not again for
  the next block when the block before holds it;
- has the next epoch's first block read when the epoch ends: with the store stalled, the
  next epoch still starts;
- holds two blocks at most, however far it has trained.
Validation reads each row group once and yields every window once, in order.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import Counter

import numpy as np
import pytest
import torch
from environments import make_env
from stream_data import (
    PARAMS,
    prepare_here,
    series_table,
    step_ids,
    stream_run_config,
    write_files,
)

from raytrain_app.config import config_from_dict
from raytrain_app.data.stream_reader import PendingBlock, PreparedFiles, read_windows
from raytrain_app.planning.rules import make_plan
from raytrain_app.worker import stream_batches
from raytrain_app.worker.stream_batches import StreamBatches

LENGTHS = {1: 30_000, 2: 20_000}
STREAM_PARAMS = {**PARAMS, "stride": 1}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("read-ahead")
    source = write_files(root / "data", series_table(lengths=LENGTHS, gaps=False))
    return source, prepare_here(str(source), STREAM_PARAMS, root / "cache")


class CountingFiles(PreparedFiles):
    """Prepared files that count their reads per (series, row group) and can stall them."""

    def __init__(self, prepared) -> None:
        super().__init__(prepared.manifest, prepared.location)
        self.reads: Counter[tuple[int, int]] = Counter()
        self.answering = threading.Event()  # cleared: every read waits, as on a stalled store
        self.answering.set()

    def read_group(self, series: int, group: int, out=None) -> np.ndarray:
        self.answering.wait()
        self.reads[(series, group)] += 1
        return super().read_group(series, group, out)


def _stream(prepared, tmp_path, lanes: int = 4) -> tuple[StreamBatches, CountingFiles]:
    source, store = prepared
    run = stream_run_config(
        "ahead",
        str(tmp_path / "runs"),
        str(source),
        str(tmp_path / "cache"),
        STREAM_PARAMS,
        global_batch_size=lanes,  # one window per lane and step
    )
    cfg = config_from_dict(run)
    files = CountingFiles(store)
    stream = StreamBatches(
        files, make_plan(cfg, make_env()), seed=3, rank=0, world_size=1, prepare=lambda x: x
    )
    return stream, files


def _lane_groups(stream: StreamBatches, epoch: int, lane: int, block: int) -> set:
    """The (series, row group) pairs that ``lane``'s block ``block`` of ``epoch`` needs."""
    order, chunks = stream._order(epoch), stream.files.manifest.chunks("train")
    chunk, _ = chunks.locate(order.sequence_ids(order.block_positions(lane, block)))
    return set(zip(chunks.series[chunk].tolist(), chunks.group[chunk].tolist(), strict=True))


def _block_groups(stream: StreamBatches, epoch: int, block: int) -> set:
    """The row groups that block ``block`` of ``epoch`` needs, over all the rank's lanes."""
    return set().union(*(_lane_groups(stream, epoch, n, block) for n in stream.my_lanes))


def _lane_reads(stream: StreamBatches, epoch: int, blocks: int) -> int:
    """Row-group reads of an epoch read lane by lane, each lane's block on its own."""
    return sum(
        len(_lane_groups(stream, epoch, lane, block))
        for lane in stream.my_lanes
        for block in range(blocks)
    )


@pytest.mark.parametrize("lanes", [4, 64])
def test_every_step_trains_the_orders_windows_with_the_values_of_a_plain_read(
    prepared, tmp_path, lanes
):
    stream, files = _stream(prepared, tmp_path, lanes)
    try:
        for epoch in (0, 1):
            order = stream._order(epoch)
            assert (order.steps > 2 * order.block) == (lanes == 4)  # several blocks, or one
            checked = {0, order.steps - 1, *range(0, order.steps, 61)}
            checked |= {b * order.block + d for b in (1, 2) for d in (-1, 0)}  # block edges
            for step, (x, y) in enumerate(stream.epoch_batches(epoch)):
                if step not in checked:
                    continue
                ids = step_ids(order, step, stream.my_lanes)
                plain_x, plain_y = read_windows(files, "train", ids).gather(slice(None))
                assert torch.equal(x, plain_x) and torch.equal(y, plain_y), (epoch, step)
    finally:
        stream.shut_down()


@pytest.mark.parametrize("lanes", [4, 64])
def test_a_row_group_is_read_once_per_block_and_not_again_for_the_next(prepared, tmp_path, lanes):
    stream, files = _stream(prepared, tmp_path, lanes)
    try:
        order = stream._order(0)
        blocks = order.block_of_step(order.steps - 1) + 1
        for _ in stream.epoch_batches(0):
            pass
        stream._ahead[1].result()  # the next epoch's first block, read ahead
        needed = [_block_groups(stream, 0, b) for b in range(blocks)]
        needed.append(_block_groups(stream, 1, 0))
        fresh = len(needed[0]) + sum(len(b - a) for a, b in itertools.pairwise(needed))
        assert sum(files.reads.values()) == fresh
        # Read lane by lane, a row group would be read by every lane block that needs it.
        lane_reads = _lane_reads(stream, 0, blocks) + len(needed[-1])
        assert fresh < lane_reads / (4 if lanes == 64 else 1), (fresh, lane_reads)
    finally:
        stream.shut_down()


def test_the_next_epochs_first_block_is_read_while_the_epoch_ends(prepared, tmp_path):
    stream, files = _stream(prepared, tmp_path)
    try:
        for _ in stream.epoch_batches(0):
            pass
        stream._ahead[1].result()
        files.answering.clear()  # the store stalls: only what was read ahead comes
        first: list = []
        taker = threading.Thread(target=lambda: first.append(next(stream.epoch_batches(1))))
        taker.start()
        taker.join(timeout=30)
        files.answering.set()
        assert first, "epoch 1's first step waited for a read"
        ids = step_ids(stream._order(1), 0, stream.my_lanes)
        assert torch.equal(first[0][0], read_windows(files, "train", ids).gather(slice(None))[0])
    finally:
        files.answering.set()
        stream.shut_down()


def test_a_rank_holds_two_blocks_at_most(prepared, tmp_path, monkeypatch):
    alive: list[weakref.ref] = []

    class TrackedBlock(PendingBlock):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            alive.append(weakref.ref(self.block.rows))

    monkeypatch.setattr(stream_batches, "PendingBlock", TrackedBlock)
    stream, _ = _stream(prepared, tmp_path)
    try:
        most = 0
        for epoch in (0, 1):
            for _ in stream.epoch_batches(epoch):
                most = max(most, sum(ref() is not None for ref in alive))
        assert len(alive) > 4 and most == 2, (len(alive), most)
    finally:
        stream.shut_down()


def test_validation_reads_each_row_group_once_and_yields_every_window_in_order(prepared, tmp_path):
    stream, files = _stream(prepared, tmp_path)
    try:
        count = stream.val_samples
        plain = read_windows(files, "val", np.arange(count, dtype=np.int64)).gather(slice(None))
        files.reads.clear()
        batches = list(stream.val)
        assert torch.equal(torch.cat([b[0] for b in batches]), plain[0])
        assert torch.equal(torch.cat([b[1] for b in batches]), plain[1])
        assert len(files.reads) > 2 and set(files.reads.values()) == {1}
    finally:
        stream.shut_down()
