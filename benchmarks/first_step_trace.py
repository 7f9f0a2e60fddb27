"""``raytrain`` CLI with timestamps of the driver's start-up phases (benchmark only).

    python -m benchmarks.first_step_trace STAMP_FILE train --config ...

Same as ``raytrain train ...``, but appends JSON lines to STAMP_FILE: the interpreter is
up, torch / ray / Ray Train / raytrain are imported, ``ray.init`` begins and ends, the
driver's preflight (data generation, checks) begins and ends, ``TorchTrainer.fit`` begins.
It only wraps functions with timers; raytrain itself is unchanged.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

_STAMP_FILE = sys.argv[1]


def stamp(event: str) -> None:
    with open(_STAMP_FILE, "a") as handle:
        handle.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid()}) + "\n")


def timed(function, name: str):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        stamp(f"{name}_start")
        try:
            return function(*args, **kwargs)
        finally:
            stamp(f"{name}_end")

    return wrapper


def main() -> int:
    stamp("interpreter_ready")
    import torch  # noqa: F401

    stamp("torch_imported")
    import ray

    stamp("ray_imported")
    import ray.train.torch

    stamp("ray_train_imported")
    from raytrain_app import cli
    from raytrain_app.driver import executors

    stamp("raytrain_imported")
    ray.init = timed(ray.init, "ray_init")
    executors.preflight = timed(executors.preflight, "preflight")
    ray.train.torch.TorchTrainer.fit = timed(ray.train.torch.TorchTrainer.fit, "fit")
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
