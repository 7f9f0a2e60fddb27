"""What a checkpoint's ``meta.json`` may make raytrain run: the factory gate.

A checkpoint is data. Its ``meta.json`` names the model and data factories by import path,
and a file in a shared run directory or bucket can be edited by anyone who can write there:
calling whatever it names (a process launcher, with params of the editor's choice) would
run their code in the caller's process. So a named factory is called only when it is

- built into raytrain,
- the very factory the caller's own config names (``config=`` / ``--config``), or
- anything, when the caller opts in (``trust_code=True`` / ``--trust-code``), as Hugging
  Face's ``trust_remote_code``;

and never, even then, from a module that lies inside the run directory itself (a ``.py``
file dropped next to the checkpoint, importable from a notebook whose working directory
holds ``runs/``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from raytrain_app.config import RaytrainConfig, config_from_dict, load_config
from raytrain_app.errors import BadInputError
from raytrain_app.workloads import BUILTIN_DATA, BUILTIN_MODELS, STREAM_FACTORY, FactoryRef

# The flag every command that loads a checkpoint takes to call a factory it names.
TRUST_FLAG = "--trust-code"
BUILTIN_TARGETS = (
    frozenset(BUILTIN_MODELS.values()) | frozenset(BUILTIN_DATA.values()) | {STREAM_FACTORY}
)


@dataclass(frozen=True)
class CodeTrust:
    """Which factories named by a checkpoint the caller lets raytrain call."""

    trust_code: bool = False
    own_targets: frozenset[str] = frozenset()  # factories the caller's own config names

    @classmethod
    def from_config(cls, config: Any, trust_code: bool = False) -> CodeTrust:
        """Trust the model and data factories ``config`` names: a ``RaytrainConfig``, a dict
        of one, or the path of its YAML file."""
        if config is None:
            return cls(trust_code)
        if isinstance(config, dict):
            config = config_from_dict(config)
        elif not isinstance(config, RaytrainConfig):
            config = load_config(config, ())
        targets = {t for t in (config.model.target, config.data.target) if t}
        return cls(trust_code, frozenset(targets))


class _Factory(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    target: str
    params: dict[str, JsonValue] = {}
    config_key: str = "model.target"


class InferenceMeta(BaseModel):
    """The part of ``meta.json`` that loading a model reads, validated as data."""

    model_config = ConfigDict(extra="allow")
    model_factory: _Factory
    data_factory: _Factory | None = None  # predict needs it, load_model does not
    data_info: dict[str, JsonValue]


def inference_meta(meta: dict[str, Any], meta_file: Path | str) -> InferenceMeta:
    """``meta`` checked to hold factories and data info of plain JSON types.

    Raises:
        BadInputError: a key is missing or of another type (the file was edited).
    """
    try:
        return InferenceMeta.model_validate(meta)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise BadInputError(
            f"'{meta_file}' is not a raytrain checkpoint's metadata ({where}: "
            f"{error['msg'].lower()}); it was edited or damaged: use a checkpoint written by "
            f"raytrain"
        ) from None


def checked_factory(
    factory: BaseModel | None, trust: CodeTrust, meta_file: Path | str, run_root: Path | None
) -> FactoryRef:
    """The ``FactoryRef`` a validated ``meta.json`` entry names, if ``trust`` allows calling it.

    Raises:
        BadInputError: the entry is missing, the factory is neither built in nor trusted,
            or its module lies inside the run directory ``run_root``.
    """
    if factory is None:
        raise BadInputError(
            f"'{meta_file}' names no data_factory, so this checkpoint's data cannot be "
            f"rebuilt; load the model with load_model and predict in your own code"
        )
    ref = FactoryRef(factory.target, dict(factory.params), factory.config_key)
    if ref.target in BUILTIN_TARGETS:
        return ref
    if ref.target not in trust.own_targets and not trust.trust_code:
        raise BadInputError(
            f"'{meta_file}' names the factory {ref.target!r}, which is not built into "
            f"raytrain, and a checkpoint's code runs only when you say so: pass {TRUST_FLAG} "
            f"(load_model(..., trust_code=True)) if you trust who wrote this run directory, "
            f"or your own config (--config) that names this factory"
        )
    if run_root is not None:
        _refuse_module_inside(ref.target, run_root, meta_file)
    return ref


def _refuse_module_inside(target: str, run_root: Path, meta_file: Path | str) -> None:
    """Refuse ``target`` when its module could be imported from a file under ``run_root``."""
    root = run_root.resolve()
    for origin in module_candidates(target.partition(":")[0]):
        if origin.is_relative_to(root):
            raise BadInputError(
                f"'{meta_file}' names the factory {target!r}, whose module would be the file "
                f"'{origin}' inside the run directory; raytrain never imports code from a run "
                f"directory: install that package or put it on PYTHONPATH elsewhere"
            )


def module_candidates(name: str) -> list[Path]:
    """Every file or package folder ``import name`` could load from ``sys.path``, found
    without running any module (finding a submodule with importlib imports its parents).

    A superset of what the import would choose, which is what a refusal needs. A module
    already imported is where it was loaded from.
    """
    loaded = sys.modules.get(name)
    if loaded is not None:
        file = getattr(loaded, "__file__", None)
        return [Path(file).resolve()] if file else []
    *packages, last = name.split(".")
    folders = [Path(entry or ".").resolve() for entry in sys.path if isinstance(entry, str)]
    for depth, part in enumerate(packages):
        parent = sys.modules.get(".".join(packages[: depth + 1]))
        if parent is not None and hasattr(parent, "__path__"):
            folders = [Path(p).resolve() for p in parent.__path__]
        else:
            folders = [folder / part for folder in folders if (folder / part).is_dir()]
    found = []
    for folder in folders:
        found += [folder / f"{last}.py", folder / last]
        found += folder.glob(f"{last}.*.so") if folder.is_dir() else []
    return [path.resolve() for path in found if path.exists()]
