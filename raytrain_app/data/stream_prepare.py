"""The prepare pass of streaming Parquet data: read and preprocess the user's files once.

Where the footers show each series in row groups of its own (or files sorted by series),
one task per series reads just those row groups (``stream_direct``); otherwise Ray Data
reads the files (one task per row group) and groups the rows by series
(``groupby().map_groups()``, an all-to-all shuffle). Either way every series must fit one
task's memory; without Ray, the same per-series function runs here. The result
is the store ``stream_manifest`` describes, in ``cache_root/<key>/``, where ``<key>`` hashes
the files (name, size, mtime) and every window parameter: a second call with the same
inputs finds the store complete (``manifest.json`` is written last) and reads no data.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from raytrain_app.data.parquet_source import DataFile, PathLike, check_files, resolve_paths
from raytrain_app.data.parquet_windows import (
    WINDOW_PARAMS,
    _build_arguments,
    _shown,
    check_window_arguments,
)
from raytrain_app.data.series_split import refuse_short_series
from raytrain_app.data.stream_budget import PrepareBudget, block_bytes, prepare_budget
from raytrain_app.data.stream_direct import GroupRead, footer_units, prepare_read
from raytrain_app.data.stream_manifest import MANIFEST_NAME, StreamManifest, split_bounds
from raytrain_app.data.stream_ray import direct_on_ray, remote_args, shuffle_on_ray
from raytrain_app.data.stream_series import (
    ReadUnit,
    SeriesSpec,
    prepare_series,
    read_unit,
)
from raytrain_app.data.stream_store import (
    FileInfo,
    build_manifest,
    complete_store,
    file_info,
    store_key,
)
from raytrain_app.data.windows import group_bounds
from raytrain_app.errors import BadInputError, first_line
from raytrain_app.storage import StorageLocation

logger = logging.getLogger(__name__)

ROWS_PER_GROUP = 4096  # rows whose windows start in one row group: one chunk, one read


@dataclass(frozen=True)
class PreparedStream:
    """A complete prepared store.

    Attributes:
        manifest: what the store holds.
        location: the folder holding ``manifest.json`` (a local path or a URI).
        reused: an existing complete store was found; nothing was read or written.
        nodes: the Ray node ids where the per-series tasks ran (empty when run here).
        path: ``direct`` (each series read from its own row groups) or ``shuffle``; empty
            when reused.
        operators: the Ray Data operators the pass ran, as its stats name them.
    """

    manifest: StreamManifest
    location: str
    reused: bool
    nodes: tuple[str, ...] = ()
    path: str = ""
    operators: tuple[str, ...] = ()


def prepare_stream(
    path: PathLike | Sequence[PathLike],
    params: Mapping[str, Any],
    cache_root: Path | StorageLocation | str,
    *,
    resources: dict[str, float] | None = None,
    rows_per_group: int | None = None,
    task_env: Mapping[str, str] | None = None,
) -> PreparedStream:
    """Prepare ``path``'s series into ``cache_root/<key>/``, or reuse what is there.

    Args:
        path: data.path: a Parquet file, a directory, a glob, a URI or a list of them (local
            paths must be readable on every node that runs a task: a shared filesystem).
        params: data.params: ``parquet_windows.WINDOW_PARAMS``, defaults as ``build_windows``.
        cache_root: where prepared stores live (a local folder or an object-store URI).
        resources: Ray custom resources every read and per-series task requests, so that
            they run only on nodes offering them (``{"data_prep": 1}``); Ray Data's own
            shuffle tasks are not bound by them.
        rows_per_group: rows per row group (default ``ROWS_PER_GROUP``, but at least four
            windows); given, it is used as is.
        task_env: environment variables the Ray Data tasks get when the data or the store
            is in an object store (the driver's S3 endpoint and keys, which workers on a
            running cluster do not see otherwise).
    """
    spot = locate_store(path, params, cache_root, rows_per_group)
    args, size, files, infos, key, store = (
        spot.args,
        spot.rows_per_group,
        spot.files,
        spot.infos,
        spot.key,
        spot.store,
    )
    found = complete_store(store, key)
    if found is not None:
        logger.info("reused prepared data in %s", store.uri)
        return PreparedStream(found, store.uri, reused=True)
    check_files(files, [*args["feature_columns"], args["target_column"]], _keys(args))
    spec = _series_spec(args, size, store, path)
    units, reads = footer_units(files, spec.group_column)
    if not units:
        raise _no_rows(spec)
    operators: tuple[str, ...] = ()
    read = (files, units, reads, spec, _read_columns(args))
    with _bad_input_from_tasks():
        if _ray_initialized():
            metadata, operators = _run_on_ray(*read, remote_args(files, spec, resources, task_env))
        else:
            metadata = _run_here(*read)
    _refuse_short_series(metadata, spec)
    manifest = build_manifest(key, args, size, metadata, infos, spec)
    store.child(MANIFEST_NAME).write_text(manifest.to_json())  # last: the store is complete
    nodes = tuple(sorted({n for n in metadata.column("node").to_pylist() if n}))
    path = "shuffle" if reads is None else "direct"
    _log_prepared(manifest, store, nodes, path)
    return PreparedStream(manifest, store.uri, False, nodes, path, operators)


@dataclass(frozen=True)
class StoreSpot:
    """Where the prepared store of some data and params lives, found from a listing alone."""

    args: dict[str, Any]  # the window params, defaults filled in
    rows_per_group: int
    files: list[DataFile]
    infos: list[FileInfo]
    key: str
    store: StorageLocation

    @property
    def source_bytes(self) -> int:
        return sum(info[1] or 0 for info in self.infos)

    def prepared(self) -> StreamManifest | None:
        """The store's manifest if it is complete (``raytrain plan`` shows it)."""
        return complete_store(self.store, self.key)

    def budget(self) -> PrepareBudget:
        """The path the prepare pass would take and what it would hold, from the files'
        footers (checked as the pass checks them); no rows read."""
        args = self.args
        check_files(self.files, [*args["feature_columns"], args["target_column"]], _keys(args))
        units, reads = footer_units(self.files, args["group_column"])
        return prepare_budget(units, reads, _read_columns(args), block_bytes())


def locate_store(
    path: PathLike | Sequence[PathLike],
    params: Mapping[str, Any],
    cache_root: Path | StorageLocation | str,
    rows_per_group: int | None = None,
) -> StoreSpot:
    """The store ``prepare_stream`` would write or reuse: params checked, files listed,
    the key computed; no data read."""
    args = _window_arguments(path, params)
    window = args["context_length"] + args["horizon"]
    size = rows_per_group if rows_per_group is not None else max(ROWS_PER_GROUP, 4 * window)
    files = [
        f if isinstance(f, StorageLocation) else Path(f).absolute() for f in resolve_paths(path)
    ]
    infos = [file_info(f) for f in files]
    key = store_key(infos, {name: args[name] for name in WINDOW_PARAMS}, size)
    return StoreSpot(args, size, files, infos, key, _location(cache_root).child(key))


def _window_arguments(path: PathLike | Sequence[PathLike], params: Mapping) -> dict[str, Any]:
    """``build_windows``'s arguments, defaults filled in and checked as it checks them."""
    args = _build_arguments({**params, "path": path})
    if args.pop("stats") is not None:
        raise BadInputError(
            "data.params.stats is not used by streaming data, which computes its statistics "
            "in the prepare pass; remove it."
        )
    features, _ = check_window_arguments(args)
    columns = [*features, args["target_column"]]
    if len(set(columns)) < len(columns):
        raise BadInputError(
            f"data.params.feature_columns and target_column name a column twice ({columns}); "
            "streaming data stores each column once: list every column once."
        )
    return {**args, "feature_columns": features}


def _keys(args: Mapping) -> list[str]:
    return [c for c in (args["group_column"], args["time_column"]) if c is not None]


def _series_spec(args: Mapping, size: int, store: StorageLocation, path: Any) -> SeriesSpec:
    return SeriesSpec(
        feature_columns=tuple(args["feature_columns"]),
        target_column=args["target_column"],
        group_column=args["group_column"],
        time_column=args["time_column"],
        window=args["context_length"] + args["horizon"],
        val_fraction=args["val_fraction"],
        missing=args["missing"],
        rows_per_group=size,
        source=f"the Parquet data {_shown(path)}",
        store=store,
    )


def _location(cache_root: Path | StorageLocation | str) -> StorageLocation:
    if isinstance(cache_root, StorageLocation):
        return cache_root
    return StorageLocation.parse(cache_root, "the streaming data cache")


def _ray_initialized() -> bool:
    import ray

    return ray.is_initialized()


def _run_here(
    files: list[DataFile],
    units: list[ReadUnit],
    reads: list[GroupRead] | None,
    spec: SeriesSpec,
    columns: list[str],
) -> pa.Table:
    """The per-series function over every series, in this process: read after read on
    the direct path (one series in memory at a time), else every row at once."""
    if reads is not None:
        parts = [part for read in reads for part in prepare_read(files, units, read, spec, columns)]
        if not parts:
            raise _no_rows(spec)
        return pa.concat_tables(parts)
    tables = [read_unit(files[u.file_index], u, columns) for u in units]
    table = pa.concat_tables(tables) if tables else None
    if table is None or table.num_rows == 0:
        raise _no_rows(spec)
    if spec.group_column is not None:
        table = table.sort_by([(spec.group_column, "ascending")])
    bounds = group_bounds(table, spec.group_column)
    return pa.concat_tables([prepare_series(table.slice(b, e - b), spec) for b, e in bounds])


def _run_on_ray(
    files: list[DataFile],
    units: list[ReadUnit],
    reads: list[GroupRead] | None,
    spec: SeriesSpec,
    columns: list[str],
    remote: dict[str, Any],
) -> tuple[pa.Table, tuple[str, ...]]:
    """The direct path where ``reads`` are known, else the shuffle; the metadata rows and
    the operators Ray Data ran."""
    if reads is not None:
        parts, operators = direct_on_ray(files, units, reads, spec, columns, remote)
    else:
        parts, operators = shuffle_on_ray(files, units, spec, columns, remote)
    if not parts:
        raise _no_rows(spec)
    return pa.concat_tables(parts), operators


def _read_columns(args: Mapping) -> list[str]:
    """The source columns the pass reads: the features, the target, group and time."""
    return [*dict.fromkeys([*args["feature_columns"], args["target_column"], *_keys(args)])]


def _refuse_short_series(metadata: pa.Table, spec: SeriesSpec) -> None:
    """Every series too short for a window, named in the order the in-memory path has."""
    if "key" in metadata.column_names:  # group values in their own order, not as text
        metadata = metadata.sort_by([("key", "ascending")])
    rows = metadata.column("rows").to_pylist()
    ids = metadata.column("id").to_pylist() if spec.group_column else [None] * len(rows)
    refuse_short_series(list(zip(ids, rows, strict=True)), spec.window, spec.val_fraction)


def _no_rows(spec: SeriesSpec) -> BadInputError:
    return BadInputError(f"{spec.source} holds no rows; point data.path at files with data.")


@contextlib.contextmanager
def _bad_input_from_tasks() -> Iterator[None]:
    """A task's BadInputError as the one line it says, not Ray's wrapped traceback."""
    try:
        yield
    except Exception as exc:
        found = _bad_input_cause(exc)
        if found is None or found is exc:
            raise
        # Ray Data appends its retry advice to the message: keep the user's one line
        raise BadInputError(first_line(found)) from None


def _bad_input_cause(exc: BaseException) -> BadInputError | None:
    """The first plain BadInputError in ``exc``'s causes (Ray's ``cause``, ``__cause__``,
    ``__context__``); Ray's own errors that merely also derive from it do not count."""
    from ray.exceptions import RayError

    pending, seen = [exc], set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, BadInputError) and not isinstance(current, RayError):
            return current
        pending += [getattr(current, "cause", None), current.__cause__, current.__context__]
    return None


def _log_prepared(
    manifest: StreamManifest, store: StorageLocation, nodes: tuple, path: str
) -> None:
    # Counted here, not by ``chunks``: its cache would make two manifests' ``==`` compare arrays
    windows = sum(
        (end - begin - manifest.window) // manifest.stride + 1
        for entry in manifest.series
        for begin, end in (split_bounds(entry, "train"), split_bounds(entry, "val"))
    )
    where = f"on {len(nodes)} Ray node(s)" if nodes else "in this process"
    logger.info(
        "Prepared %d series (%d windows) from %d file(s), %d bytes read, %s, %s, into %s",
        len(manifest.series),
        windows,
        manifest.source_files,
        manifest.source_bytes,
        where,
        "each series from its own row groups" if path == "direct" else "through a shuffle",
        store.uri,
    )
