"""Benchmark-only model factory: the built-in WindTransformer, timestamping its first step.

``model.target: benchmarks.first_step_probe:build`` with ``model.params.stamp_file``. The
step function's 2nd call in the rank-0 process comes right after the first optimizer step
finished (with accumulation 1): it appends ``time.time()`` to the stamp file as JSON lines.
It also stamps the model build and the first call (the first batch is ready), and the
process's start time, so the cold start can be broken down. With ``model.params.trace``,
it also wraps a few calls the worker makes between the model build and the first batch
with timers (benchmark-only, at run time); raytrain's code is not changed.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from raytrain_app.models import wind_transformer
from raytrain_app.protocol import ModelSpec, StepOutput

_calls = 0  # step calls in this process


def _in_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_rank_zero() -> bool:
    return not _in_process_group() or dist.get_rank() == 0


def stamp(path: str, event: str, **extra: Any) -> None:
    """Append one ``{"event", "t", "pid", ...}`` line to ``path``."""
    line = {"event": event, "t": time.time(), "pid": os.getpid(), **extra}
    with open(path, "a") as handle:
        handle.write(json.dumps(line) + "\n")


def _process_start_time() -> float | None:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil comes with ray[default]; the breakdown is optional
        return None


def _step(module: Any, batch: Any, *, inner: Any, stamp_file: str) -> StepOutput:
    global _calls
    _calls += 1
    if _calls <= 2 and _is_rank_zero():
        stamp(stamp_file, "first_batch_ready" if _calls == 1 else "first_step_done")
    return inner(module, batch)


def _timed(owner: Any, name: str, stamp_file: str) -> None:
    """Replace ``owner.name`` by a version that stamps its start and end on rank 0."""
    original = getattr(owner, name)
    if getattr(original, "_probe_timed", False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_rank_zero():
            stamp(stamp_file, f"{name}_start")
        try:
            return original(*args, **kwargs)
        finally:
            if _is_rank_zero():
                stamp(stamp_file, f"{name}_end")

    wrapper._probe_timed = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _trace_worker_setup(stamp_file: str) -> None:
    """Time what a Ray Train worker does between the model build and the first batch."""
    import ray.train
    import ray.train.torch

    from raytrain_app.worker import loop

    _timed(ray.train.torch, "prepare_model", stamp_file)
    _timed(ray.train.torch, "prepare_data_loader", stamp_file)
    _timed(ray.train, "get_checkpoint", stamp_file)
    _timed(loop, "gather", stamp_file)


def build(params: Mapping[str, Any], data_info: Mapping[str, Any]) -> ModelSpec:
    """``wind_transformer.build`` with ``params`` minus ``stamp_file`` and ``trace``."""
    params = dict(params)
    stamp_file = params.pop("stamp_file")
    trace = params.pop("trace", False)
    spec = wind_transformer.build(params, data_info)
    if _in_process_group() and _is_rank_zero():  # a training worker, not the driver's check
        stamp(stamp_file, "worker_model_built", process_start=_process_start_time())
    if trace and _in_process_group():
        _trace_worker_setup(stamp_file)
    return ModelSpec(
        module=spec.module,
        step=functools.partial(_step, inner=spec.step, stamp_file=stamp_file),
        predict=spec.predict,
    )
