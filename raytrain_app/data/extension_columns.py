"""Parquet columns of an Arrow extension type are refused: reading one can run code.

An extension type's values become Python objects through code that whoever registered the
type chose. Ray Data registers ``ray.data.arrow_pickled_object``, whose values are
unpickled (``to_pylist``, ``as_py``, and the sort sampling of Ray Data's ``groupby``), in
every process that imports ``ray.train``: workers and Ray Data tasks. Any file can declare
such a column (pyarrow keeps the name in the field's metadata while the type is not
registered), and data files are shared, so raytrain reads only plain Arrow types.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from raytrain_app.errors import BadInputError

_EXTENSION_NAME = b"ARROW:extension:name"  # pyarrow's key for an unregistered type


def refuse_extension_columns(file: object, schema: pa.Schema, columns: Sequence[str]) -> None:
    """Refuse ``file`` if any of ``columns`` in its ``schema`` is, or nests, an extension
    type, registered in this process or not.

    Raises:
        BadInputError: one line naming the file, the column and the type.
    """
    for name in columns:
        found = _extension_in(schema.field(name))
        if found is not None:
            raise BadInputError(
                f"Column {name!r} of data file '{file}' has the Arrow extension type "
                f"{found!r}, which raytrain does not read (its values could be unpickled, "
                "which runs code); write the column as plain numbers or strings, or leave "
                "the file out of data.path."
            )


def _extension_in(field: pa.Field) -> str | None:
    """The name of the extension type ``field`` is or holds, None if there is none."""
    kind = field.type
    if isinstance(kind, pa.ExtensionType):
        return kind.extension_name
    declared = (field.metadata or {}).get(_EXTENSION_NAME)
    if declared is not None:
        return declared.decode(errors="replace")
    if isinstance(kind, pa.DictionaryType):
        return _extension_in(pa.field(field.name, kind.value_type))
    children = (_extension_in(kind.field(i)) for i in range(kind.num_fields))
    return next((name for name in children if name is not None), None)
