"""Walking the schema's keys: sections, free-form mappings, and unknown keys with a suggestion."""

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from raytrain_app.config.base import ConfigError
from raytrain_app.config.schema import RaytrainConfig

_SECTIONS = tuple(RaytrainConfig.model_fields)


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    """The model class of a section field, or None for a plain value field; a section
    that may also be a name or null (``train.optimizer``, ``train.early_stopping``) counts,
    so its dotted keys can be set and swept."""
    tp = field.annotation
    union = get_origin(tp) in (typing.Union, types.UnionType)
    models = [m for m in (get_args(tp) if union else (tp,)) if _is_model(m)]
    return models[0] if len(models) == 1 else None


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _is_free_form(field: FieldInfo) -> bool:
    """Whether the field is a free-form mapping (``params``, ``param_space``)."""
    return get_origin(field.annotation) is dict


def _schema_paths(model: type[BaseModel] = RaytrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key the schema defines, sections first then their keys."""
    paths = []
    for key, field in model.model_fields.items():
        paths.append(prefix + key)
        sub = _section_model(field)
        if sub is not None:
            paths.extend(_schema_paths(sub, f"{prefix}{key}."))
    return paths


def _unknown_key(path: str, model: type[BaseModel], source: str) -> ConfigError:
    """Build the error for an unknown key, suggesting the closest valid one."""
    prefix, _, key = path.rpartition(".")
    prefix = f"{prefix}." if prefix else ""
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    if close:
        hint = f"did you mean '{prefix}{close[0]}'?"
    else:
        # a right key in the wrong section (`lr` at top level) is a common slip
        elsewhere = [p for p in _schema_paths() if p.rpartition(".")[2] == key]
        if elsewhere:
            hint = f"did you mean {' or '.join(repr(p) for p in elsewhere)}?"
        else:
            scope = f"in '{prefix[:-1]}'" if prefix else "at the top level"
            hint = f"valid keys {scope}: {', '.join(model.model_fields)}"
    return ConfigError(f"unknown config key '{path}' ({hint}){source}")


def _check_keys(
    data: Mapping[Any, Any], source: str, model: type[BaseModel] = RaytrainConfig, prefix: str = ""
) -> None:
    """Raise for the first key that the schema does not define; free-form dicts are skipped."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            raise _unknown_key(path, model, source)
        sub = _section_model(field)
        if sub is not None and isinstance(value, Mapping):
            _check_keys(value, source, sub, f"{path}.")
