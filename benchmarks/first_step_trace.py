"""``raytrain`` CLI with timestamps of the driver's start-up (benchmark only).

    python -m benchmarks.first_step_trace STAMP_FILE train --config ...

Same as ``raytrain train ...``, importing what it imports in the order it does, but appends
JSON lines to STAMP_FILE: the interpreter is up; the imports of ray, torch, Ray Train's
torch package and raytrain's driver begin and end (``<name>_import_start``,
``<name>_imported``); ``ray.init`` begins and ends (in whichever thread calls it); the
driver's checks before Ray (``Launch.checked``), its preflight (data generation, checks)
and ``TorchTrainer.fit`` begin. It only wraps functions with timers as their modules load;
raytrain itself is unchanged.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_STAMP_FILE = sys.argv[1]
_LOCK = threading.Lock()


def stamp(event: str) -> None:
    line = {"event": event, "t": time.time(), "pid": os.getpid()}
    with _LOCK, open(_STAMP_FILE, "a") as handle:
        handle.write(json.dumps(line) + "\n")


def timed(function: Callable, name: str) -> Callable:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stamp(f"{name}_start")
        try:
            return function(*args, **kwargs)
        finally:
            stamp(f"{name}_end")

    return wrapper


def _wrap_ray_init(ray: Any) -> None:
    ray.init = timed(ray.init, "ray_init")


def _wrap_checks(launch: Any) -> None:
    launch.Launch.checked = classmethod(timed(launch.Launch.checked.__func__, "checks"))


def _wrap_preflight(executors: Any) -> None:
    executors.preflight = timed(executors.preflight, "preflight")


def _wrap_fit(ray_train_torch: Any) -> None:
    ray_train_torch.TorchTrainer.fit = timed(ray_train_torch.TorchTrainer.fit, "fit")


# Module -> (the name its stamps carry, what to wrap in it once it is loaded).
_TRACED: dict[str, tuple[str | None, Callable[[Any], None] | None]] = {
    "ray": ("ray", _wrap_ray_init),
    "torch": ("torch", None),
    "ray.train.torch": ("ray_train", _wrap_fit),
    "raytrain_app.driver.training": ("raytrain", None),
    "raytrain_app.driver.launch": (None, _wrap_checks),
    "raytrain_app.driver.executors": (None, _wrap_preflight),
}


class _ImportStamps(importlib.abc.MetaPathFinder):
    """Stamps the start and end of the imports of ``_TRACED`` and wraps their functions
    once loaded, whichever thread imports them."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TRACED:
            return None
        label, wrap = _TRACED.pop(name)
        spec = next(
            (
                found
                for finder in sys.meta_path
                if finder is not self and hasattr(finder, "find_spec")
                for found in [finder.find_spec(name, path, target)]
                if found is not None
            ),
            None,
        )
        if spec is None or spec.loader is None:
            return spec
        if label:
            stamp(f"{label}_import_start")
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if wrap:
                wrap(module)
            if label:
                stamp(f"{label}_imported")

        spec.loader.exec_module = exec_module
        return spec


def main() -> int:
    stamp("interpreter_ready")
    sys.meta_path.insert(0, _ImportStamps())
    from raytrain_app import cli

    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
