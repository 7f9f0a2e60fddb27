"""A sine-regression workload that injects faults on cue, for the reliability tests.

``model.params`` choose the fault, counted in training micro-batches of this process
(``call`` 1 is the first): ``nan_at_calls`` (a NaN loss; only on ``nan_rank`` if given),
``kill_rank`` + ``kill_at_call`` + ``marker`` (SIGKILL this worker once, when the marker
file does not exist yet),
``hang_rank`` + ``hang_at_call`` (sleep far past any timeout), ``sleep_s`` (slow every
step down so a test can act mid-run), ``dropout`` (random masks, so resumes must restore
every rank's RNG to be exact), ``record_comm_hooks`` (rank 0 writes the DDP communication
hooks it trains with, and its process's niceness, to this JSON file), ``oom_above``
(batches larger than this raise ``torch.OutOfMemoryError`` after the forward pass, as a
GPU would; a list gives one limit per rank), ``inf_grad_at_calls`` (a finite loss whose
gradient is infinite, as an fp16 overflow), ``batchnorm`` (a BatchNorm1d after the first
layer), ``breakpoint_at_call`` + ``marker`` (a ``breakpoint()`` in the step, as a user
debugging it, while the marker file does not exist yet).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from sine_regression import build_data
from torch import nn

from raytrain_app import ModelSpec, StepOutput

__all__ = ["build_data", "build_model"]


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_model(params: dict, data_info: dict) -> ModelSpec:
    hidden = int(params.get("hidden", 32))
    layers = [
        nn.Linear(data_info["in_features"], hidden),
        *([nn.BatchNorm1d(hidden)] if params.get("batchnorm") else []),
        nn.Tanh(),
        nn.Dropout(float(params.get("dropout", 0.0))),
        nn.Linear(hidden, 1),
    ]
    module = nn.Sequential(*layers)
    calls = 0

    def step(model: nn.Module, batch) -> StepOutput:
        nonlocal calls
        x, y = batch
        if model.training:
            calls += 1
            _inject(params, calls)
            if params.get("record_comm_hooks") and _rank() == 0:
                _record_comm_hooks(model, calls, Path(params["record_comm_hooks"]))
        prediction = model(x)
        if x.shape[0] > _oom_above(params):  # after the forward, as a GPU runs out part-way
            raise torch.OutOfMemoryError("stand-in for CUDA running out of memory")
        if model.training and calls in params.get("inf_grad_at_calls", ()):
            prediction = _InfiniteGradient.apply(prediction)
        loss = nn.functional.mse_loss(prediction, y)
        nan_here = params.get("nan_rank") in (None, _rank())
        if model.training and nan_here and calls in params.get("nan_at_calls", ()):
            loss = loss * float("nan")
        return StepOutput(loss=loss, num_samples=y.shape[0])

    return ModelSpec(module=module, step=step)


def _oom_above(params: dict) -> float:
    limit = params.get("oom_above")
    if isinstance(limit, list):  # one limit per rank
        limit = limit[_rank()]
    return float("inf") if limit is None else limit


class _InfiniteGradient(torch.autograd.Function):
    """The identity whose gradient is infinite: a finite loss with an overflowing backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


def _inject(params: dict, calls: int) -> None:
    if params.get("sleep_s"):
        time.sleep(float(params["sleep_s"]))
    if _rank() == params.get("kill_rank") and calls == params.get("kill_at_call"):
        marker = Path(params["marker"])
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
    if _rank() == params.get("hang_rank") and calls == params.get("hang_at_call"):
        time.sleep(3600)
    if calls == params.get("breakpoint_at_call") and not Path(params["marker"]).exists():
        breakpoint()  # a user's, for the local mode's test


def _record_comm_hooks(model: nn.Module, calls: int, path: Path) -> None:
    """The DDP communication hooks registered on the model this step runs, and how often
    they have run (PowerSGD counts its all-reduces in ``state.iter``)."""
    hooks = getattr(model, "_comm_hooks", [])
    path.write_text(
        json.dumps(
            {
                "calls": calls,
                "hooks": [hook.__name__ for hook, _ in hooks],
                "niceness": os.nice(0),
                "iter": [getattr(state, "iter", None) for _, state in hooks],
            }
        )
    )
