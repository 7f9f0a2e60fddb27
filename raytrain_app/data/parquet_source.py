"""Finding Parquet files, checking their footers and reading numeric columns from them.

Every problem with the files is a ``BadInputError`` that names the file or column and
what to change, so the driver can report it before any cluster starts.
"""

from __future__ import annotations

import fnmatch
import glob
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from raytrain_app.data.extension_columns import refuse_extension_columns
from raytrain_app.data.missing import refuse_missing
from raytrain_app.errors import BadInputError, first_line
from raytrain_app.storage import StorageLocation, is_uri

PathLike = str | Path
# A resolved Parquet file: a local path, or a file in an object store (``s3://...``).
DataFile = Path | StorageLocation


def resolve_paths(path: PathLike | Sequence[PathLike]) -> list[DataFile]:
    """Expand a file, directory, glob or sequence of them into a sorted list of Parquet files.

    Each may be a local path or a URI (``s3://bucket/data/``, ``s3://bucket/data/*.parquet``),
    whose files are listed through pyarrow's filesystems.
    """
    items = [path] if isinstance(path, (str, Path)) else list(path)
    files: list[DataFile] = []
    for item in items:
        item_str = str(item)
        if is_uri(item_str):
            files.extend(_resolve_uri(item_str))
        elif glob.has_magic(item_str):
            files.extend(Path(p) for p in sorted(glob.glob(item_str, recursive=True)))
        elif Path(item_str).is_dir():
            files.extend(sorted(Path(item_str).rglob("*.parquet")))
        elif Path(item_str).is_file():
            files.append(Path(item_str))
    files = [f for f in files if isinstance(f, StorageLocation) or f.is_file()]
    if not files:
        raise BadInputError(
            f"No Parquet files match data path {path!r}; give a file, a directory or a glob "
            "such as 'data/*.parquet'."
        )
    return files


def _resolve_uri(text: str) -> list[StorageLocation]:
    """The Parquet files a URI names: one file, every ``.parquet`` file under a prefix, or
    the files matching a glob (``*`` may match across ``/``, as in ``fnmatch``)."""
    location = StorageLocation.parse(text, "data.path")
    if not glob.has_magic(location.path):
        if location.is_file():
            return [location]
        files = location.list_dir(recursive=True, files_only=True)
        return [f for f in files if f.path.endswith(".parquet")]
    parent = location
    while glob.has_magic(parent.path) and "/" in parent.path:
        parent = parent.parent
    if glob.has_magic(parent.path):  # a pattern in the bucket's name
        return []
    files = parent.list_dir(recursive=True, files_only=True)
    return [f for f in files if fnmatch.fnmatchcase(f.path, location.path)]


def _file_schema(file: DataFile) -> pa.Schema:
    """The schema in a Parquet file's footer; a missing or torn footer names the file."""
    try:
        if isinstance(file, StorageLocation):
            return pq.read_schema(file.path, filesystem=file.filesystem)
        return pq.read_schema(file)
    except PermissionError:
        raise BadInputError(
            f"Data file '{file}' cannot be read (permission denied); make it readable "
            "(chmod +r) or point data.path elsewhere."
        ) from None
    except (pa.ArrowException, OSError) as exc:
        raise BadInputError(
            f"Data file '{file}' is not a readable Parquet file ({first_line(exc)}); it may be "
            "truncated or in another format: write it again as Parquet or leave it out of "
            "data.path."
        ) from None


def check_files(
    path: PathLike | Sequence[PathLike], numeric: Sequence[str], other: Sequence[str] = ()
) -> list[DataFile]:
    """Resolve ``path`` and check every file's footer, columns and column types; read no rows.

    Args:
        path: a Parquet file, a directory (searched recursively), a glob, or a list of them.
        numeric: columns that must be numeric (the features, then the target).
        other: further columns that must exist (group and time columns).

    Returns:
        The resolved Parquet files.
    """
    files = resolve_paths(path)
    columns = [*dict.fromkeys([*numeric, *other])]
    first: tuple[DataFile, pa.Schema] | None = None
    for file in files:
        schema = _file_schema(file)
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise BadInputError(
                f"Column(s) {missing} not found in data file '{file}'; available columns: "
                f"{schema.names}; fix the column names in data.params or the file."
            )
        refuse_extension_columns(file, schema, columns)  # before any row is read
        for name in numeric:
            column_type = schema.field(name).type
            if not (pa.types.is_integer(column_type) or pa.types.is_floating(column_type)):
                raise BadInputError(
                    f"Column {name!r} of data file '{file}' has type {column_type}; it must be "
                    "numeric: convert it in the file or leave it out of data.params."
                )
        first = first or (file, schema)
        _refuse_type_drift(first, file, schema, columns)
    return files


def _refuse_type_drift(
    first: tuple[DataFile, pa.Schema], file: DataFile, schema: pa.Schema, columns: list[str]
) -> None:
    """Every file gives each read column the first file's type: the prepare pass
    concatenates the files' rows, which pyarrow refuses when types differ, and the
    in-memory read casts them to the first file's type (losing digits silently, or failing
    on a value that type cannot hold)."""
    first_file, first_schema = first
    for name in columns:
        expected, found = first_schema.field(name).type, schema.field(name).type
        if found != expected:
            raise BadInputError(
                f"Column {name!r} is {found} in data file '{file}' but {expected} in "
                f"'{first_file}'; every file must give a column the same type: write the "
                "files again with one type for it (cast it) or leave the odd file out of the "
                "data path."
            )


def read_table(files: list[DataFile], columns: list[str]) -> pa.Table:
    """Read only ``columns`` from ``files`` (already checked by ``check_files``)."""
    remote = [f for f in files if isinstance(f, StorageLocation)]
    filesystem = remote[0].filesystem if remote else None
    paths = [f.path if isinstance(f, StorageLocation) else str(f) for f in files]
    try:
        dataset = pads.dataset(paths, format="parquet", filesystem=filesystem)
        return dataset.to_table(columns=columns)
    except (pa.ArrowException, OSError) as exc:
        # a footer can be intact while a page inside the file is not
        raise BadInputError(
            f"The Parquet data in data.path cannot be read ({first_line(exc)}); write the "
            "damaged file again or leave it out of data.path."
        ) from None


def column_as_float(table: pa.Table, name: str, *, allow_missing: bool = False) -> np.ndarray:
    """One column as float64 numpy; missing values become NaN.

    Unless ``allow_missing`` (the caller fills them: ``data.params.missing``), missing or
    non-finite values are refused with their count and the option that fills them.
    """
    column = table.column(name)
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise BadInputError(f"Column {name!r} has type {column.type}; it must be numeric.")
    values = pc.fill_null(column.cast(pa.float64()), float("nan")).to_numpy()
    if not allow_missing:
        refuse_missing(values, name)
    return values


def feature_matrix(
    table: pa.Table, feature_columns: list[str], *, allow_missing: bool = False
) -> np.ndarray:
    """``[rows, len(feature_columns)]`` float64 features; zero columns is allowed."""
    if not feature_columns:
        # The model then sees only the target's own past.
        return np.empty((table.num_rows, 0))
    return np.stack(
        [column_as_float(table, c, allow_missing=allow_missing) for c in feature_columns], axis=1
    )
