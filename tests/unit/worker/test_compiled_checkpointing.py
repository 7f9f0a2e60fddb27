"""The day-one path of an H100 user, on CPU: the memory probe finds the batch too big and
turns gradient checkpointing on by itself, then the worker compiles the model
(``model_setup.prepare_for_training``) and trains the checkpointed ResNet compiled.

torch.compile runs with the ``aot_eager`` backend (AOT autograd's functionalization and
partitioner, as inductor, without a C++ build); the product's own call is otherwise
unchanged. resnet_small's checkpoint crashed dynamo here before (``checkpoint not
implemented for NestedUserFunctionVariable context_fn``).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from loop_harness import LocalSession, worker_task
from torch import nn

from raytrain_app.config import config_from_dict
from raytrain_app.protocol import ModelSpec, StepOutput
from raytrain_app.worker import worker_setup
from raytrain_app.worker.loop import WorkerLoop, WorkerTask

FITS_WITHOUT_CHECKPOINTING = 4  # images per micro-batch; the plan asks for 16


@pytest.fixture
def compile_on_cpu(monkeypatch):
    """The product's ``torch.compile(model)``, given a backend that needs no compiler."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    yield
    torch._dynamo.reset()


def _image_task(tmp_path: Path) -> WorkerTask:
    raw = {
        "experiment": {"name": "compiled", "output_dir": str(tmp_path / "runs"), "seed": 2},
        "model": {"name": "resnet_small", "params": {"widths": [8, 16]}},
        "data": {
            "name": "synthetic_images",
            "params": {"num_train": 64, "num_val": 16, "image_size": 16, "pad": 2},
        },
        "train": {"epochs": 1, "global_batch_size": 16, "lr": 0.01, "max_batch_per_worker": "auto"},
        "scaling": {"num_workers": 1},
        "dataloader": {"num_workers": 0},
    }
    task = worker_task(config_from_dict(raw), tmp_path / "runs" / "compiled")
    # What the plan turns on for a GPU with compute capability >= 8 (forced: this is a CPU).
    task.plan = replace(
        task.plan, compile=True, memory_probe=True, gradient_checkpointing_auto=True
    )
    return task


def _out_of_memory_without_checkpointing(monkeypatch) -> None:
    """The built-in model, whose micro-batches above 4 images "run out of memory" (a
    stand-in raised after the forward, as CUDA's) unless checkpointing is on."""
    build = worker_setup.build_model

    def build_with_limit(ref, data_info) -> ModelSpec:
        spec = build(ref, data_info)
        bare = spec.module

        def step(model: nn.Module, batch) -> StepOutput:
            out = spec.step(model, batch)
            too_big = batch[0].shape[0] > FITS_WITHOUT_CHECKPOINTING
            if model.training and too_big and not bare.gradient_checkpointing:
                raise torch.OutOfMemoryError("stand-in for CUDA running out of memory")
            return out

        return replace(spec, step=step)

    monkeypatch.setattr(worker_setup, "build_model", build_with_limit)


@pytest.mark.usefixtures("compile_on_cpu")
def test_the_probe_turns_checkpointing_on_and_the_compiled_resnet_trains(tmp_path, monkeypatch):
    _out_of_memory_without_checkpointing(monkeypatch)
    task = _image_task(tmp_path)
    assert not task.plan.gradient_checkpointing  # auto: off until the probe needs it
    loop = WorkerLoop(task, LocalSession(tmp_path / "ckpt"))
    result = loop.run()

    # The probe turned checkpointing on, so the whole micro-batch fits.
    assert result["gradient_checkpointing"] is True
    assert loop.module.gradient_checkpointing is True
    assert (result["per_worker_batch_size"], result["grad_accum_steps"]) == (16, 1)
    # The model trained is the compiled one, and dynamo did compile graphs of it.
    assert isinstance(loop.stepper.model, torch._dynamo.eval_frame.OptimizedModule)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    history = result["history"]
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["train_loss"]))
