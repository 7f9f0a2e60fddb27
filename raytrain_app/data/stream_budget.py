"""What the prepare pass holds, and where: the path it takes and the sizes that bound it.

Computed on the driver from the footers (``stream_direct.footer_units``), before any row is
read: ``raytrain plan`` shows it, and docs/users/streaming-data.md says what each number
means for the driver, the prepare tasks and Ray's object store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from raytrain_app.data.stream_direct import GroupRead
from raytrain_app.data.stream_series import ReadUnit

# The sort shuffle holds the data three times over in the object store at its peak: the
# blocks read, the pieces its map tasks cut them into and the reduce tasks' sorted blocks
# (Ray Data frees a stage's inputs only when the whole sort is done).
SHUFFLE_COPIES = 3
# A shuffle task holds up to this many blocks in its own memory beyond an idle worker's:
# its input (read, or gathered from the sort's pieces), the copy it sorts or cuts, and
# Arrow's and Python's buffers around them; as many such tasks run at once as CPUs. Measured
# (private PSS above an idle worker's): 2.5 blocks of 32 MiB, 3.4 of 16 MiB; the whole pass
# within this budget: tests/distributed/test_stream_prepare_on_ray.py.
SHUFFLE_TASK_COPIES = 4


@dataclass(frozen=True)
class PrepareBudget:
    """The prepare pass's path and the sizes that bound its memory.

    Attributes:
        path: ``direct`` (a task per series reads its own row groups; nothing moves
            between tasks) or ``shuffle`` (the series are interleaved in the files).
        data_bytes: the columns the pass reads, in memory (``data_bytes``).
        task_bytes: the most rows one task holds, in memory: the largest read (direct:
            one series, or the series starting in one row group of a sorted file), or one
            block (shuffle; a series larger than a block is held whole by its task).
        object_store_bytes: what the pass puts in Ray's object store at its peak: its
            tasks' metadata (direct), or the data ``SHUFFLE_COPIES`` times over (shuffle),
            spilled to local disk beyond the object store's capacity.
        tasks: the tasks that prepare series (direct) or read blocks (shuffle).
    """

    path: Literal["direct", "shuffle"]
    data_bytes: int
    task_bytes: int
    object_store_bytes: int
    tasks: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prepare_budget(
    units: Sequence[ReadUnit],
    reads: Sequence[GroupRead] | None,
    columns: Sequence[str],
    block_bytes: int,
) -> PrepareBudget:
    """The budget of a pass over ``units`` (``reads``: the direct path's, or None)."""
    total = data_bytes(sum(unit.rows for unit in units), columns)
    if reads is not None:
        largest = max((sum(units[i].rows for i in read.units) for read in reads), default=0)
        return PrepareBudget("direct", total, data_bytes(largest, columns), 0, len(reads))
    blocks = shuffle_blocks(units, columns, block_bytes)
    return PrepareBudget("shuffle", total, -(-total // blocks), SHUFFLE_COPIES * total, blocks)


def shuffle_blocks(units: Sequence[ReadUnit], columns: Sequence[str], block_bytes: int) -> int:
    """How many blocks the shuffle reads the data in: about ``block_bytes`` each.

    The pull-based sort's driver keeps a reference (about 3 KB) per pair of input and
    output blocks, and the pieces of under 100 KB it moves, on the driver's heap (Ray
    keeps small task results with their owner): a block per row group of small row groups
    put the whole data on the driver. Blocks of Ray Data's target size keep both small."""
    total = data_bytes(sum(unit.rows for unit in units), columns)
    return max(1, min(len(units), -(-total // block_bytes)))


def data_bytes(rows: int, columns: Sequence[str]) -> int:
    """The read columns' rows in memory, with the file and row position columns: 8 bytes
    a value (float64, int64; a text group column counts as one)."""
    return rows * (len(columns) + 2) * 8


def block_bytes() -> int:
    """Ray Data's target block size (``DataContext.target_max_block_size``)."""
    from ray.data.context import DataContext

    return DataContext.get_current().target_max_block_size
