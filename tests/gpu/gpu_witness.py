"""A GPU-tier test workload: another model factory, unchanged, whose step writes down what
only the training worker sees, so a test of ``rt.train`` can prove what ran rather than
count step calls.

``model.params``: ``inner`` (a built-in model name or a ``module:factory`` target, e.g.
``faults:build_model``), ``inner_params`` (its params), ``record_dir`` (each rank writes
``rank<r>.json`` there) and ``count_all_reduces`` (count DDP's gradient all-reduces, in
the step agreement's communication hook). The record:

- ``model_types``: the types of the models the training steps ran (``OptimizedModule``
  when compiled; the bare module's for the memory probe's steps);
- ``unique_graphs``: the graphs dynamo compiled in this process
  (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``);
- ``autocast``: the CUDA autocast dtype of the last training step, or None;
- ``batch_devices``: the device types of every tensor of every training batch;
- ``checkpointing``: the bare module's ``gradient_checkpointing`` flag;
- ``calls``: training steps run (micro-batches); ``all_reduces``: gradient all-reduces.

The record is rewritten at every step, validation's included, so it is complete once the
run has ended.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.protocol import ModelSpec, StepOutput
from raytrain_app.workloads import BUILTIN_MODELS, FactoryRef
from raytrain_app.workloads import build_model as build_inner


def build_model(params: dict, data_info: dict) -> ModelSpec:
    params = dict(params)
    inner = params.pop("inner")
    target = BUILTIN_MODELS.get(inner, inner)
    spec = build_inner(FactoryRef(target, dict(params.pop("inner_params", {}))), data_info)
    record_dir = Path(params.pop("record_dir"))
    count = params.pop("count_all_reduces", False)
    if params:
        raise ValueError(f"unknown gpu_witness params: {sorted(params)}")
    record: dict[str, Any] = {
        "calls": 0,
        "model_types": [],
        "unique_graphs": 0,
        "autocast": None,
        "batch_devices": [],
        "checkpointing": None,
        "all_reduces": _count_all_reduces() if count and _in_process_group() else None,
    }
    bare = spec.module

    def step(model: nn.Module, batch: Any) -> StepOutput:
        if model.training:
            _note_training_step(record, model, batch)
        record["checkpointing"] = getattr(bare, "gradient_checkpointing", None)
        out = spec.step(model, batch)
        _write(record, record_dir)
        return out

    return ModelSpec(
        module=bare,
        step=step,
        predict=spec.predict,
        metrics_from_counts=spec.metrics_from_counts,
    )


def _note_training_step(record: dict[str, Any], model: nn.Module, batch: Any) -> None:
    record["calls"] += 1
    record["model_types"] = sorted({*record["model_types"], type(model).__name__})
    devices = {tensor.device.type for tensor in _tensors(batch)}
    record["batch_devices"] = sorted({*record["batch_devices"], *devices})
    on = torch.is_autocast_enabled("cuda")
    record["autocast"] = str(torch.get_autocast_dtype("cuda")) if on else None


def _write(record: dict[str, Any], record_dir: Path) -> None:
    utils = sys.modules.get("torch._dynamo.utils")  # imported by torch.compile
    if utils is not None:
        record["unique_graphs"] = int(utils.counters["stats"]["unique_graphs"])
    if isinstance(record["all_reduces"], list):  # the counting hook's cell
        record = {**record, "all_reduces": record["all_reduces"][0]}
    record_dir.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if _in_process_group() else 0
    (record_dir / f"rank{rank}.json").write_text(json.dumps(record))


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, tuple | list):
        for item in batch:
            yield from _tensors(item)


def _in_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _count_all_reduces() -> list[int]:
    """Count the gradient all-reduces of this worker's DDP model: the step agreement's hook
    (``step_agreement.py``) runs once per bucket; its last bucket, once per all-reduce.

    Patched in the worker process only (its process group exists, the driver's does not),
    before the worker wraps the model and registers the hook.
    """
    from raytrain_app.worker import step_agreement

    hook = step_agreement._all_reduce_with_flags
    if hasattr(hook, "cell"):  # patched already: count once
        return hook.cell
    cell = [0]

    # No annotations: DDP checks a hook's against its own classes.
    def counted(agreement, bucket):
        cell[0] += bool(bucket.is_last())
        return hook(agreement, bucket)

    counted.cell = cell
    step_agreement._all_reduce_with_flags = counted
    return cell


def read_records(record_dir: Path) -> list[dict[str, Any]]:
    """Every rank's record, rank 0 first."""
    paths = sorted(record_dir.glob("rank*.json"), key=lambda p: int(p.stem[len("rank") :]))
    return [json.loads(path.read_text()) for path in paths]
