"""Typed run configuration: YAML loading, ``--set`` overrides and one-line errors.

The pydantic models of ``config_schema`` are the single source of truth for every config
key and default (re-exported here). YAML files and ``--set key=value`` overrides are only
data merged on top of them; any problem surfaces as a :class:`ConfigError` whose message is
one sentence naming the key, the bad value and what is allowed.
"""

import difflib
import logging
import os
import re
import tempfile
import types
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from raytrain_app.config.schema import (
    ConfigError,
    DataConfig,
    DataloaderConfig,
    DistributedConfig,
    ExperimentConfig,
    FaultToleranceConfig,
    ModelConfig,
    RaytrainConfig,
    ScalingConfig,
    TrainConfig,
    TuneConfig,
    _OneSource,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "DataloaderConfig",
    "DistributedConfig",
    "ExperimentConfig",
    "FaultToleranceConfig",
    "ModelConfig",
    "RaytrainConfig",
    "ScalingConfig",
    "TrainConfig",
    "TuneConfig",
    "config_from_dict",
    "config_to_dict",
    "config_with_values",
    "diff_configs",
    "dump_config_yaml",
    "flatten",
    "load_config",
    "save_config",
]

logger = logging.getLogger(__name__)

BUILTIN_CONFIG = "quickstart.yaml"
BUILTIN_SWEEP = "wind_sweep.yaml"

# --------------------------------------------------------------------------- YAML


_YAML12_FLOAT = re.compile(r"[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """Safe YAML loader that reads ``3e-4`` as a float and rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """Build a mapping, failing on a key given twice instead of keeping the last one."""
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key_node.value!r}",
                        key_node.start_mark,
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Safe YAML dumper that quotes strings like ``'3e-4'`` so they load back as strings."""


# YAML 1.1 (PyYAML) needs a dot in a float, so `lr: 3e-4` would silently become a string
for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789"))


def _load_yaml(text: str) -> Any:
    """Parse one YAML document with ``_Loader`` (safe: it only builds plain Python types)."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _parse_yaml(text: str, label: str) -> dict[str, Any]:
    """Parse a config document into a mapping; ``label`` names its source in errors."""
    try:
        data = _load_yaml(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        # a tab is the commonest slip, and PyYAML's wording for it does not say so
        fix = "indent with spaces, not tabs" if "'\\t'" in problem else "fix the YAML syntax there"
        raise ConfigError(f"{label} is not valid YAML: {problem}{at}; {fix}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{label} is not valid YAML: {exc}; fix its YAML syntax") from None
    if data is None:
        # most likely the wrong file, or one whose write was cut short
        raise ConfigError(
            f"{label} is empty; give it at least one config section (see raytrain_app/configs/"
            f"{BUILTIN_CONFIG}), or leave out --config to run the built-in quickstart"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{label} must contain a mapping of config sections ({', '.join(_SECTIONS)}) "
            f"at the top level, not {_kind(data)}"
        )
    return data


def _read_config_text(path: str | Path | None, builtin: str) -> tuple[str, str]:
    """Return the YAML text of ``path`` (or the built-in config) and a label for errors."""
    if path is None:
        text = (resources.files("raytrain_app") / "configs" / builtin).read_text(encoding="utf-8")
        return text, f"built-in config '{builtin}'"
    label = f"config file '{path}'"
    file = Path(path).expanduser()
    if not file.exists():
        raise ConfigError(f"{label} not found; pass an existing YAML file with --config")
    if file.is_dir():
        raise ConfigError(f"{label} is a directory; pass a YAML file with --config")
    try:
        return file.read_text(encoding="utf-8"), label
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise ConfigError(f"cannot read {label}: {reason}") from None


# --------------------------------------------------------------------------- schema walking


_SECTIONS = tuple(RaytrainConfig.model_fields)


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    """The model class of a section field, or None for a plain value field."""
    tp = field.annotation
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


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


# --------------------------------------------------------------------------- overrides


def _parse_value(raw: str) -> Any:
    """Parse an override value as YAML, so ``4``, ``3e-4``, ``true`` and ``null`` are typed."""
    try:
        return _load_yaml(raw)
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
    _apply_value(data, parts, _parse_value(raw), flag)
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


# --------------------------------------------------------------------------- validation errors


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
    text = repr(value)
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
    if field is None:
        return dotted, f"invalid config: {reason or error['msg']}"
    if reason and _section_model(field) is not None:
        return dotted, f"invalid config section '{dotted}': {reason}"
    value = _show(_lookup(data, path))
    return dotted, f"invalid value for '{dotted}': {value} ({reason or _allowed(field)})"


def _validate(
    data: dict[str, Any], sources: list[tuple[list[str], str]], default: str
) -> RaytrainConfig:
    """Validate merged data; name the --set flag or file the failing key came from."""
    try:
        return RaytrainConfig.model_validate(data)
    except ValidationError as exc:
        dotted, message = _error_message(exc, data)
        source = default
        for parts, flag in reversed(sources):
            key = ".".join(parts)
            if key == dotted or key.startswith(f"{dotted}.") or dotted.startswith(f"{key}."):
                source = f", from {flag}"
                break
        raise ConfigError(f"{message}{source}") from exc


# --------------------------------------------------------------------------- public API


def _plain(data: Mapping[Any, Any]) -> dict[Any, Any]:
    """A copy of nested mappings as plain dicts, so overrides never touch the caller's data."""
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _build(data: Mapping[str, Any], overrides: Sequence[str], source: str) -> RaytrainConfig:
    """Check keys, apply overrides in order (later wins) and validate."""
    if isinstance(overrides, str):
        # a lone string would be iterated character by character
        overrides = [overrides]
    merged = _plain(data)
    _check_keys(merged, source)
    sources = [(_apply_override(merged, item), f"--set {item}") for item in overrides]
    return _validate(merged, sources, source)


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> RaytrainConfig:
    """Validate a config given as nested mappings, after applying ``key=value`` overrides."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, not {_kind(data)}")
    return _build(data, overrides, "")


def config_with_values(
    cfg: RaytrainConfig, values: Mapping[str, Any], label: str = "--set"
) -> RaytrainConfig:
    """``cfg`` with typed values at dotted keys (``{"train.lr": 3e-4}``), validated.

    Errors name the key and ``label`` (e.g. ``tune.param_space``) as their source.
    """
    merged = config_to_dict(cfg)
    sources = []
    for key, value in values.items():
        flag = f"{label} {key}={_show(value)}"
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"invalid key '{key}' in {label}: use a dotted key like train.lr")
        _apply_value(merged, parts, value, flag)
        sources.append((parts, flag))
    return _validate(merged, sources, f", from {label}")


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), builtin: str = BUILTIN_CONFIG
) -> RaytrainConfig:
    """Load a YAML config (the built-in ``builtin`` when ``path`` is None), apply overrides."""
    text, label = _read_config_text(path, builtin)
    config = _build(_parse_yaml(text, label), overrides, f", in {label}")
    logger.debug("loaded %s with %d override(s)", label, len(overrides))
    return config


def config_to_dict(cfg: RaytrainConfig) -> dict[str, Any]:
    """The config as plain JSON/YAML-serialisable data, in schema order."""
    return cfg.model_dump(mode="json")


def dump_config_yaml(cfg: RaytrainConfig) -> str:
    """The config as YAML text that :func:`load_config` reads back to an equal config."""
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def save_config(cfg: RaytrainConfig, path: str | Path) -> Path:
    """Write the config as YAML atomically, so a crash never leaves a half-written file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(dump_config_yaml(cfg))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def flatten(d: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings to ``{"a.b.c": value}``; empty mappings stay as leaves."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, path))
        else:
            flat[path] = value
    return flat


def diff_configs(a: RaytrainConfig, b: RaytrainConfig, ignore: Iterable[str] = ()) -> list[str]:
    """Sorted dotted keys whose values differ between two configs, except under ``ignore``."""
    flat_a, flat_b = flatten(config_to_dict(a)), flatten(config_to_dict(b))
    prefixes = tuple(ignore)
    missing = object()
    changed = [
        key
        for key in dict.fromkeys([*flat_a, *flat_b])
        if flat_a.get(key, missing) != flat_b.get(key, missing)
        and not any(key == p or key.startswith(f"{p}.") for p in prefixes)
    ]
    # `params: {}` against `params: {x: 1}` differs at both levels; the deeper key says it all
    return sorted(key for key in changed if not any(o.startswith(f"{key}.") for o in changed))
