"""Benchmark-only model factory for the GPU benchmark: the built-in WindTransformer whose
step function profiles a window of training steps in the rank-0 process and writes the
share of that window during which the GPU was busy (``model.params.busy_file``).

``profile_from`` / ``profile_steps``: the window, in training-step calls of this process
(validation calls, with the module in eval mode, are not counted). raytrain is unchanged.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from raytrain_app.models import wind_transformer
from raytrain_app.protocol import ModelSpec, StepOutput


def busy_share(events: Any, wall_s: float) -> float:
    """Fraction of ``wall_s`` covered by the union of the GPU activity in ``events``."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy_us, current_start, current_end = 0.0, None, None
    for start, end in intervals:
        if current_end is None or start > current_end:
            if current_end is not None:
                busy_us += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy_us += current_end - current_start
    return busy_us / (wall_s * 1e6)


class StepProfiler:
    """Profiles calls ``start`` .. ``start + count`` of a step function."""

    def __init__(self, start: int, count: int) -> None:
        self.start, self.count, self.calls = start, count, 0
        self.profiler: Any = None
        self.began = 0.0
        self.result: float | None = None

    def before_call(self) -> None:
        self.calls += 1
        if self.calls == self.start:
            torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            self.profiler.__enter__()
            self.began = time.perf_counter()
        elif self.calls == self.start + self.count and self.profiler is not None:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.began
            self.profiler.__exit__(None, None, None)
            self.result = busy_share(self.profiler.events(), wall)
            self.profiler = None


_profiler: StepProfiler | None = None


def _step(module: Any, batch: Any, *, inner: Any, busy_file: str, window: tuple) -> StepOutput:
    global _profiler
    rank_zero = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if rank_zero and module.training:
        if _profiler is None:
            _profiler = StepProfiler(*window)
        _profiler.before_call()
        if _profiler.result is not None:
            with open(busy_file, "w") as handle:
                json.dump({"busy_share": _profiler.result, "steps": window[1]}, handle)
            _profiler.result = None
    return inner(module, batch)


def build(params: Mapping[str, Any], data_info: Mapping[str, Any]) -> ModelSpec:
    """``wind_transformer.build`` minus ``busy_file``, ``profile_from``, ``profile_steps``."""
    params = dict(params)
    busy_file = params.pop("busy_file")
    window = (int(params.pop("profile_from")), int(params.pop("profile_steps")))
    spec = wind_transformer.build(params, data_info)
    return ModelSpec(
        module=spec.module,
        step=functools.partial(_step, inner=spec.step, busy_file=busy_file, window=window),
        predict=spec.predict,
    )
