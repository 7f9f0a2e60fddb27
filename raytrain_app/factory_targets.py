"""The config's ``model.target`` / ``data.target`` (``"package.module:function"``) as
names, checked without importing torch or the user's code: ``raytrain_app.train`` looks
them up before an embedded Ray starts for the run (``driver/run_start.py``), and
``workloads.import_target`` imports them with the same messages.
"""

from __future__ import annotations

import importlib.util

from raytrain_app.config import DataConfig, ModelConfig
from raytrain_app.errors import BadInputError


def locate_targets(model: ModelConfig, data: DataConfig) -> None:
    """Check that ``model.target`` and ``data.target`` name modules on the path, without
    importing them (their parent packages only): a misspelt module is refused in one line
    before an embedded Ray starts for the run. ``workloads.check_sources`` imports them."""
    for target, key in ((model.target, "model.target"), (data.target, "data.target")):
        if not target:
            continue
        module_name, _ = split_target(target, key)
        try:
            found = importlib.util.find_spec(module_name)
        except (ImportError, ValueError) as exc:  # a parent package that is not there
            raise not_importable(target, key, str(exc)) from None
        if found is None:
            raise not_importable(target, key, f"No module named {module_name!r}")


def split_target(target: str, config_key: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``"package.module:function"``; one line naming
    ``config_key`` when it is not of that form."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise BadInputError(
            f"{config_key}={target!r} is not of the form 'package.module:function'; "
            f"fix {config_key}"
        )
    return module_name, attr


def not_importable(target: str, config_key: str, reason: str) -> BadInputError:
    """The one line for a target whose module cannot be imported, and the fix."""
    return BadInputError(
        f"{config_key}={target!r} cannot be imported ({reason}); install the package or "
        f"add its directory to PYTHONPATH"
    )
