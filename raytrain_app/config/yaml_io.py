"""YAML text in and out: the safe loader and dumper, reading a config file, atomic saving.

PyYAML is wrapped so that YAML 1.2 floats like ``3e-4`` load as numbers, a key given
twice is an error, and a document may not expand past a size a config plausibly has (an
alias is a reference: nine lines of aliases of aliases stand for a billion values, which
the first deep copy or dump of the config would build); every problem becomes a one-line
:class:`ConfigError`.
"""

import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from raytrain_app.config.base import ConfigError
from raytrain_app.config.keys import _SECTIONS
from raytrain_app.config.messages import _kind
from raytrain_app.config.schema import RaytrainConfig
from raytrain_app.storage.location import temporary_file

# files in raytrain_app/configs/, read when no --config is given
BUILTIN_CONFIG = "quickstart.yaml"
BUILTIN_SWEEP = "wind_sweep.yaml"

# Far above any real config (the built-in ones are under 2 KB and 200 values) and far below
# what takes a noticeable time or memory to read, copy and dump.
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 100
_TOO_DEEP = f"it nests values more than {MAX_YAML_DEPTH} levels deep; flatten it"

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


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _too_big(root: yaml.Node) -> str | None:
    """Why the document ``root`` is too big to load and what to do, or None: its size
    counts an aliased value at every place it is used, as the loaded config holds it.

    Iterative (an explicit stack), so that no document can exhaust Python's recursion.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[key] > MAX_YAML_VALUES:
                return (
                    f"it expands to more than {MAX_YAML_VALUES} values, counting a *alias at "
                    f"every use; write the values out or nest fewer &anchors/*aliases"
                )
        elif key in on_path:
            return "a *alias refers to a value that contains it; remove that alias"
        elif key not in sizes:
            if depth > MAX_YAML_DEPTH:
                return _TOO_DEEP
            on_path.add(key)
            stack.append((node, depth, True))
            stack.extend((child, depth + 1, False) for child in _children(node))
    return None


def _load_yaml(text: str, label: str) -> Any:
    """Parse one YAML document with ``_Loader`` (safe: it only builds plain Python types);
    ``label`` names its source in errors."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        reason = None if node is None else _too_big(node)
        if reason:
            raise ConfigError(f"{label} is too large to load: {reason}")
        return None if node is None else loader.construct_document(node)
    except RecursionError:
        # PyYAML composes nested collections recursively: thousands of '[' exhaust the stack
        raise ConfigError(f"{label} is too large to load: {_TOO_DEEP}") from None
    finally:
        loader.dispose()


def _parse_yaml(text: str, label: str) -> dict[str, Any]:
    """Parse a config document into a mapping; ``label`` names its source in errors."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{label} is too large to load: {len(text)} characters, more than "
            f"{MAX_CONFIG_BYTES}; a config holds settings, not data"
        )
    try:
        data = _load_yaml(text, label)
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
        with file.open("rb") as handle:
            # one byte over the cap is enough to refuse, without reading a huge file whole
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{label} is too large to load: more than {MAX_CONFIG_BYTES} bytes; pass "
                f"the YAML config file with --config, not a data file"
            )
        return raw.decode("utf-8"), label
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise ConfigError(f"cannot read {label}: {reason}") from None


def config_to_dict(cfg: RaytrainConfig) -> dict[str, Any]:
    """The config as plain JSON/YAML-serialisable data, in schema order."""
    return cfg.model_dump(mode="json")


def dump_config_yaml(cfg: RaytrainConfig) -> str:
    """The config as YAML text that :func:`load_config` reads back to an equal config."""
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def save_config(cfg: RaytrainConfig, path: str | Path) -> Path:
    """Write the config as YAML atomically, so a crash never leaves a half-written file."""
    target = Path(path)
    fd, tmp = temporary_file(target)  # the mode a plain write gets, for others to read
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(dump_config_yaml(cfg))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
