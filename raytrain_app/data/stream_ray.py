"""The prepare pass on Ray Data: the direct path (a task per series, reading its own row
groups) or the shuffle (``groupby().map_groups()``, for interleaved series).

Both return the per-series tasks' metadata rows, one a series, and the names of the
operators Ray Data ran, read from the dataset's stats (so a log, or a test, can tell a
shuffle from none). The driver gathers nothing else: the tasks write the series' files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from raytrain_app.data.parquet_source import DataFile
from raytrain_app.data.stream_budget import block_bytes, shuffle_blocks
from raytrain_app.data.stream_direct import GroupRead, prepare_reads_on_ray
from raytrain_app.data.stream_series import (
    ReadUnit,
    SeriesSpec,
    prepare_series_on_ray,
    read_batch,
)
from raytrain_app.storage import StorageLocation

_OPERATOR = re.compile(r"^Operator \d+ (.+?): ", re.MULTILINE)


def direct_on_ray(
    files: list[DataFile],
    units: list[ReadUnit],
    reads: list[GroupRead],
    spec: SeriesSpec,
    columns: list[str],
    remote: dict[str, Any],
) -> tuple[list[pa.Table], tuple[str, ...]]:
    """One task per read (per series where the row groups hold one each); no shuffle."""
    import ray.data

    items = [{"read": i} for i in range(len(reads))]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(
        prepare_reads_on_ray,
        batch_size=None,
        batch_format="pyarrow",
        fn_kwargs={
            "files": files,
            "units": units,
            "reads": reads,
            "spec": spec,
            "columns": columns,
        },
        **remote,
    )
    return _metadata(ds), _operators(ds)


def shuffle_on_ray(
    files: list[DataFile],
    units: list[ReadUnit],
    spec: SeriesSpec,
    columns: list[str],
    remote: dict[str, Any],
) -> tuple[list[pa.Table], tuple[str, ...]]:
    """Tasks read the row groups in blocks of Ray Data's target size, a sort by series
    gathers each series, and a task per sorted block prepares the series in it."""
    import ray.data
    from ray.data.context import ShuffleStrategy

    items = [{"unit": i} for i in range(len(units))]
    blocks = shuffle_blocks(units, columns, block_bytes())
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    # This dataset's own context (a copy): a sort shuffle runs as plain tasks, where the
    # default hash shuffle starts a pool of aggregator actors on every run (seconds each,
    # on any node, whatever ``resources`` say).
    ds.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    ds = ds.map_batches(
        read_batch,
        batch_size=None,
        batch_format="pyarrow",
        fn_kwargs={"files": files, "units": units, "columns": columns},
        **remote,
    )
    ds = ds.groupby(spec.group_column).map_groups(
        prepare_series_on_ray, batch_format="pyarrow", fn_kwargs={"spec": spec}, **remote
    )
    return _metadata(ds), _operators(ds)


def remote_args(
    files: Sequence[DataFile],
    spec: SeriesSpec,
    resources: Mapping[str, float] | None,
    task_env: Mapping[str, str] | None,
) -> dict[str, Any]:
    """What every task of the pass asks Ray for: ``resources``, and the driver's object
    store variables where the data or the store is in one."""
    remote: dict[str, Any] = {"resources": dict(resources)} if resources else {}
    if any(isinstance(f, StorageLocation) for f in [*files, spec.store]) and task_env:
        # workers on a running cluster do not see this process's S3 endpoint and keys
        remote["runtime_env"] = {"env_vars": dict(task_env)}
    return remote


def _metadata(ds: Any) -> list[pa.Table]:
    """The metadata rows the tasks returned (one a series): all the driver holds."""
    return [b for b in ds.iter_batches(batch_size=None, batch_format="pyarrow") if b.num_rows]


def _operators(ds: Any) -> tuple[str, ...]:
    """The operators Ray Data ran for ``ds``, in order, as its stats name them."""
    return tuple(_OPERATOR.findall(ds.stats()))
