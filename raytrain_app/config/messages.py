"""Pydantic validation errors as one sentence naming the key, the bad value and what is allowed."""

import math
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from raytrain_app.config.keys import _section_model
from raytrain_app.config.schema import RaytrainConfig
from raytrain_app.storage.location import redact_credentials


def _kind(value: Any) -> str:
    """A short phrase for a value's YAML type, used in messages."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return f"the value {_show(value)}"


def _show(value: Any) -> str:
    """Render a value the way a YAML user would recognise it, on one short line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        # as the user wrote it: Python's inf and nan are not YAML
        return ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    # before shortening, which could cut a URI's credentials off from the '@' that marks them
    text = redact_credentials(repr(value))
    return text if len(text) <= 60 else f"{text[:57]}..."


def _bounds(constraints: Iterable[Any]) -> str:
    """Render numeric constraints as `` >= 0 and < 1``."""
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = []
    for item in constraints:
        for attr, symbol in symbols.items():
            bound = getattr(item, attr, None)
            if isinstance(item, annotated_types.BaseMetadata) and bound is not None:
                parts.append(f"{symbol} {bound}")
    return f" {' and '.join(parts)}" if parts else ""


def _alternatives(tp: Any, constraints: Sequence[Any] = ()) -> list[tuple[str, bool]]:
    """Describe what a type accepts as ``(phrase, is_literal_value)`` alternatives."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        more = [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        return _alternatives(base, [*constraints, *more])
    if origin in (Union, types.UnionType):
        return [alt for arg in get_args(tp) for alt in _alternatives(arg, constraints)]
    if origin is Literal:
        return [(str(value), True) for value in get_args(tp)]
    if tp is type(None):
        return [("null", False)]
    if tp is bool:
        return [("true", True), ("false", True)]
    if tp is int:
        return [(f"an integer{_bounds(constraints)}", False)]
    if tp is float:
        return [(f"a number{_bounds(constraints)}", False)]
    if tp is str:
        empty_ok = not any(getattr(c, "min_length", 0) for c in constraints)
        return [("a string" if empty_ok else "a non-empty string", False)]
    if origin is dict:
        return [("a mapping with string keys", False)]
    if origin is list:  # the [min, max] worker range, the only list in the schema
        (item,) = get_args(tp)
        items = [phrase.replace("an integer", "integers", 1) for phrase, _ in _alternatives(item)]
        return [(f"[min, max] of {phrase}", False) for phrase in items]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [(f"a mapping with keys {', '.join(tp.model_fields)}", False)]
    return [(getattr(tp, "__name__", str(tp)), False)]


def _allowed(field: FieldInfo) -> str:
    """One phrase saying what a field accepts, e.g. ``must be an integer >= 1``."""
    alternatives = _alternatives(field.annotation, field.metadata)
    phrases = [phrase for phrase, _ in alternatives]
    if all(is_literal for _, is_literal in alternatives):
        return f"allowed: {', '.join(phrases)}"
    joined = phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} or {phrases[-1]}"
    return f"must be {joined}"


def _resolve_loc(loc: Sequence[Any]) -> tuple[list[str], FieldInfo | None]:
    """Map a pydantic error location onto the schema's keys (dropping union tags, dict keys)."""
    model: type[BaseModel] | None = RaytrainConfig
    path: list[str] = []
    field = None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            break
        field = model.model_fields[part]
        path.append(part)
        model = _section_model(field)
    return path, field


def _lookup(data: Mapping[str, Any], path: Sequence[str]) -> Any:
    """The raw value at ``path`` in the merged input data, or None when absent."""
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _error_message(exc: ValidationError, data: Mapping[str, Any]) -> tuple[str, str]:
    """Turn the first pydantic error into ``(dotted key, one-sentence message)``.

    Unknown keys never reach here: ``_check_keys`` reports them first, with a suggestion.
    """
    error = exc.errors()[0]
    path, field = _resolve_loc(error["loc"])
    dotted = ".".join(path)
    reason = None
    if error["type"] == "value_error":
        reason = str(error.get("ctx", {}).get("error", error["msg"]))
    if error["type"] == "finite_number" and field is not None:
        # the field's own phrase ("a number > 0") reads as if .inf satisfied it
        reason = _allowed(field).replace("a number", "a finite number")
    if field is None:
        return dotted, f"invalid config: {reason or error['msg']}"
    if reason and _section_model(field) is not None:
        return dotted, f"invalid config section '{dotted}': {reason}"
    value = _show(_lookup(data, path))
    return dotted, f"invalid value for '{dotted}': {value} ({reason or _allowed(field)})"
