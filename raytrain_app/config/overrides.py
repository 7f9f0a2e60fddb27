"""``--set key=value`` overrides: parsing them to typed values and applying them to config data."""

from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel

from raytrain_app.config.base import ConfigError
from raytrain_app.config.keys import _check_keys, _is_free_form, _section_model, _unknown_key
from raytrain_app.config.messages import _show
from raytrain_app.config.run_sections import _OneSource
from raytrain_app.config.schema import RaytrainConfig
from raytrain_app.config.yaml_io import _load_yaml


def _parse_value(raw: str, flag: str) -> Any:
    """Parse an override value as YAML, so ``4``, ``3e-4``, ``true`` and ``null`` are typed."""
    try:
        return _load_yaml(raw, flag)
    except yaml.YAMLError:
        # e.g. `data.path=*.parquet` is not valid YAML (an alias) but is plainly a string
        return raw


def _override_owner(parts: list[str], flag: str) -> type[BaseModel] | None:
    """Check an override key against the schema; return the model owning its last key."""
    model: type[BaseModel] = RaytrainConfig
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            raise _unknown_key(".".join(parts[: i + 1]), model, f", from {flag}")
        sub = _section_model(field)
        if sub is not None:
            model = sub
            continue
        if i == len(parts) - 1:
            return model
        if _is_free_form(field):
            return None
        owner_key = ".".join(parts[: i + 1])
        raise ConfigError(
            f"cannot set '{'.'.join(parts)}' with {flag}: '{owner_key}' is a single value, "
            f"not a section; set it as --set {owner_key}=VALUE"
        )
    return None  # the key names a whole section


def _split_override(item: str) -> tuple[str, list[str], str]:
    """Split ``a.b.c=value`` into the flag text, the key's parts and the raw value."""
    flag = f"--set {item}"
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep:
        raise ConfigError(
            f"invalid override '{flag}': expected KEY=VALUE, e.g. --set train.lr=3e-4"
        )
    if not all(parts):
        raise ConfigError(f"invalid override '{flag}': '{key}' is not a dotted key like train.lr")
    return flag, parts, raw


def _set_path(data: dict[str, Any], parts: list[str], value: Any, flag: str) -> dict[str, Any]:
    """Set ``data[a][b][c] = value``, creating mappings on the way; return the parent mapping."""
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(
                f"cannot set '{'.'.join(parts)}' with {flag}: '{'.'.join(parts[: depth + 1])}' "
                f"holds the value {_show(child)}, not a mapping"
            )
        node = child
    node[parts[-1]] = value
    return node


def _apply_override(data: dict[str, Any], item: str) -> list[str]:
    """Apply one ``a.b.c=value`` override to ``data`` in place; return the key's parts."""
    flag, parts, raw = _split_override(item)
    _apply_value(data, parts, _parse_value(raw, flag), flag)
    return parts


def _apply_value(data: dict[str, Any], parts: list[str], value: Any, flag: str) -> None:
    """Set the typed ``value`` at the dotted key ``parts``, checked against the schema."""
    owner = _override_owner(parts, flag)
    if isinstance(value, Mapping):
        # a mapping given on the command line gets the same unknown-key check as a file
        nested: Any = value
        for part in reversed(parts):
            nested = {part: nested}
        _check_keys(nested, f", from {flag}")
    parent = _set_path(data, parts, value, flag)
    switches_source = owner is not None and issubclass(owner, _OneSource) and value is not None
    if switches_source and parts[-1] in owner.SOURCE_KEYS:
        # `--set model.target=...` replaces the file's model.name rather than clashing with it
        for other in owner.SOURCE_KEYS:
            if other != parts[-1]:
                parent.pop(other, None)
