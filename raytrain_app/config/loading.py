"""Typed run configuration: loading YAML and ``--set`` overrides, comparing configs.

The pydantic models of ``schema`` are the single source of truth for every config key and
default. YAML files and ``--set key=value`` overrides are only data merged on top of them;
any problem surfaces as a :class:`ConfigError` whose message is one sentence naming the key,
the bad value and what is allowed.
"""

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from raytrain_app.config.base import ConfigError
from raytrain_app.config.keys import _check_keys
from raytrain_app.config.messages import _error_message, _kind, _show
from raytrain_app.config.overrides import _apply_override, _apply_value
from raytrain_app.config.schema import RaytrainConfig
from raytrain_app.config.yaml_io import (
    BUILTIN_CONFIG,
    _parse_yaml,
    _read_config_text,
    config_to_dict,
)

logger = logging.getLogger(__name__)


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


def config_from_yaml(text: str, label: str) -> RaytrainConfig:
    """Validate a config given as YAML text (a run's ``config.yaml`` read from storage);
    ``label`` names its source in errors, as ``load_config``'s do."""
    return _build(_parse_yaml(text, label), (), f", in {label}")


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
