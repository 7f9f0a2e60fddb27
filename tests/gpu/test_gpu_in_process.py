"""One GPU, in this process without Ray: the worker loop, the memory probe and the batch
loaders as a Ray worker runs them, for the proofs that need their objects.

- fp16: the GradScaler skips the step whose gradient overflowed (the weights stay as they
  were) and lowers its scale, with the fused AdamW and compile a GPU plan picks;
- the memory probe stops at a real CUDA out-of-memory, with the reserve for what training
  adds later held: the same probe without the reserve would pick a bigger micro-batch, and
  does with an optimizer that keeps no state (plain SGD);
- batches of any shape (NamedTuple, ``BatchEncoding``-like, dataclass) arrive on the GPU
  through every session's loader, copied on a side stream while the previous batch trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from batch_shapes import Encoding
from environments import make_env
from loop_harness import LocalSession, make_task
from torch import nn
from torch.utils.data import DataLoader

from raytrain_app.config import config_from_dict
from raytrain_app.planning.environment import Environment, GpuInfo
from raytrain_app.planning.rules import make_plan
from raytrain_app.protocol import ModelSpec, StepOutput, collate
from raytrain_app.worker import memory_probe
from raytrain_app.worker.loop import WorkerLoop
from raytrain_app.worker.memory_probe import fit_plan_to_memory
from raytrain_app.worker.session import InProcessSession, RayTrainSession, to_device
from raytrain_app.worker.step import OptimizerStep

CUDA = torch.device("cuda", 0)
MIB = 2**20


def this_gpu() -> Environment:
    """This machine as a one-GPU worker node, for the plan."""
    props = torch.cuda.get_device_properties(0)
    gpu = GpuInfo(props.name, torch.cuda.get_device_capability(0), props.total_memory / 2**30)
    return make_env(cpus=2, gpus=1, gpu=gpu)


class CudaSession(LocalSession):
    """The loop harness's one-worker session (checkpoints kept in a folder), on this GPU."""

    def __init__(self, storage: Path) -> None:
        super().__init__(storage)
        self._device = CUDA


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# --------------------------------------------------------------------------- fp16


INF_GRAD_CALL = 9  # 2 micro-batches a step: the 5th optimizer step overflows


def test_fp16_the_scaler_skips_the_overflowing_step_and_lowers_its_scale(tmp_path, monkeypatch):
    task = make_task(
        tmp_path,
        epochs=2,
        max_batch_per_worker=16,  # 2 micro-batches a step
        model_params={"inf_grad_at_calls": [INF_GRAD_CALL]},
    )
    task.config["precision"] = "fp16"
    task.plan = make_plan(config_from_dict(task.config), this_gpu())
    assert task.plan.grad_scaler and task.plan.fused_optimizer
    steps: list[dict[str, Any]] = []
    apply = OptimizerStep.apply

    def recording_apply(stepper: OptimizerStep, step: int) -> None:
        before = (_state(stepper.module), stepper.scaler.get_scale())
        apply(stepper, step)
        steps.append(
            {
                "step": step,
                "before": before,
                "after": (_state(stepper.module), stepper.scaler.get_scale()),
            }
        )

    monkeypatch.setattr(OptimizerStep, "apply", recording_apply)
    loop = WorkerLoop(task, CudaSession(tmp_path / "ckpt"))
    result = loop.run()

    scaler = loop.stepper.scaler
    assert scaler.is_enabled() and scaler._device == "cuda"
    autocast = loop.stepper.autocast()
    assert (autocast.device, autocast.fast_dtype) == ("cuda", torch.float16)
    skipped = {s["step"] for s in steps if s["after"][1] < s["before"][1]}  # scale backed off
    assert 5 in skipped  # the forced overflow
    for s in steps:
        weights_before, weights_after = s["before"][0], s["after"][0]
        changed = [k for k, v in weights_before.items() if not torch.equal(weights_after[k], v)]
        # A skipped step leaves every weight as it was; a step taken moves them.
        assert (not changed) if s["step"] in skipped else changed, s["step"]
    history = result["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]


# --------------------------------------------------------------------------- memory probe


class Sample(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


WIDTH = 2 * MIB  # floats a sample holds for the backward pass: 8 MiB
BALLAST = 128 * MIB // 4  # parameters no step uses: only the probe's reserve counts them


class Hungry(nn.Module):
    """Activations in proportion to the batch, and parameters large enough that the probe's
    reserve (AdamW's two moments and the gradients: 3 times their bytes) decides which
    micro-batch fits."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((WIDTH,), 0.01))
        self.ballast = nn.Parameter(torch.zeros(BALLAST))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).exp().mean(dim=1)  # exp keeps [batch, WIDTH] for backward


def _step(model: nn.Module, batch: Sample) -> StepOutput:
    loss = nn.functional.mse_loss(model(batch.x), batch.y)
    return StepOutput(loss=loss, num_samples=batch.x.shape[0])


def _peak(spec: ModelSpec, module: nn.Module, samples: list[Sample], size: int) -> int:
    """The bytes allocated above what was before, at the peak of one forward and backward
    of ``size`` samples, as the probe runs them. Allocated, not reserved: under a memory
    cap the allocator frees its cached blocks and retries before it gives up."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    batch = to_device(collate(samples[:size]), CUDA)
    spec.step(module, batch).loss.backward()
    module.zero_grad(set_to_none=True)
    del batch
    peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.empty_cache()
    return peak


PLAIN_SGD = {"target": "torch.optim:SGD", "params": {}}


@pytest.mark.parametrize(
    ("optimizer", "fits"), [("adamw", 8), (PLAIN_SGD, 16)], ids=["adamw", "plain_sgd"]
)
def test_the_memory_probe_stops_at_real_cuda_memory_with_the_reserve_held(
    tmp_path, optimizer, fits
):
    """The GPU's memory is capped (``set_per_process_memory_fraction``) between what 8 and
    16 samples need with AdamW's reserve held; without the reserve 16 would fit, and it
    does with plain SGD, whose smaller reserve the probe measures on the optimizer itself.
    The batches are NamedTuples, which the probe moves itself."""
    module = Hungry().to(CUDA)
    spec = ModelSpec(module=module, step=_step)
    samples = [Sample(torch.rand(1), torch.rand(())) for _ in range(32)]
    peak8, peak16 = _peak(spec, module, samples, 8), _peak(spec, module, samples, 16)
    task = make_task(
        tmp_path, global_batch_size=16, max_batch_per_worker="auto", optimizer=optimizer
    )
    # The whole GPU is this worker's (gpus_per_worker 1): the reserve is the training state.
    plan = replace(
        task.plan,
        per_worker_batch_size=16,
        grad_accum_steps=1,
        memory_probe=True,
        use_gpu=True,
        gpus_per_worker=1.0,
    )

    def reserve(optimizer: Any) -> int:
        train = config_from_dict(
            {**task.config, "train": {**task.config["train"], "optimizer": optimizer}}
        ).train
        state = memory_probe.optimizer_state_per_param_byte(spec, train, plan)
        return memory_probe.training_state_bytes(module, plan, state)

    adamw, plain_sgd = reserve("adamw"), reserve(PLAIN_SGD)
    budget = adamw + (peak8 + peak16) / 2
    # What makes this test prove the reserve: 8 samples fit beside AdamW's with room to
    # spare (half the difference: the allocator's rounding and fragmentation), 16 do not,
    # and 16 would fit the same memory without it, and do beside plain SGD's.
    assert peak8 + adamw < budget < peak16 + adamw and peak16 < budget
    assert peak16 - peak8 > 64 * MIB and peak16 + plain_sgd < budget
    train = config_from_dict(task.config).train

    torch.cuda.empty_cache()
    limit = torch.cuda.memory_reserved() + budget
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.mem_get_info()[1])
    try:
        fitted = fit_plan_to_memory(
            plan, spec, module, samples, contextlib.nullcontext, CUDA, 1, train, collate
        )
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert (fitted.per_worker_batch_size, fitted.grad_accum_steps) == (fits, 16 // fits)
    assert fitted.max_batch_per_worker == fits


# --------------------------------------------------------------------------- batches


@dataclasses.dataclass
class Images:
    pixels: torch.Tensor
    labels: torch.Tensor


def _batch(indices: list[int]) -> dict[str, Any]:
    """A batch of every shape, large enough (8 MiB a tensor) that a copy takes a while."""
    start = float(indices[0])
    big = torch.full((len(indices), MIB // len(indices) * 2), start)
    return {
        "pair": Sample(big, torch.tensor(indices, dtype=torch.float32)),
        "text": Encoding({"input_ids": big + 1}, encodings=[indices]),
        "images": Images(big + 2, torch.tensor(indices)),
    }


@pytest.mark.parametrize("session_kind", ["in_process", "ray_train"])
def test_batches_of_any_shape_arrive_on_the_gpu_through_the_loaders(session_kind, monkeypatch):
    if session_kind == "ray_train":
        monkeypatch.setattr(RayTrainSession, "device", lambda self: CUDA)
        session = RayTrainSession.__new__(RayTrainSession)  # no Ray Train context needed
    else:
        session = InProcessSession(device="cuda:0")
    loader = DataLoader(list(range(64)), batch_size=8, collate_fn=_batch, pin_memory=True)
    batches = 0
    for index, batch in enumerate(session.prepare_loader(loader)):
        start = float(index * 8)
        pair, text, images = batch["pair"], batch["text"], batch["images"]
        assert (type(pair), type(text), type(images)) == (Sample, Encoding, Images)
        assert text._encodings == [list(range(index * 8, index * 8 + 8))]
        # Read at once on the training stream: a copy still under way would show here.
        assert pair.x.device == CUDA and torch.all(pair.x == start).item()
        assert text.input_ids.device == CUDA and torch.all(text.input_ids == start + 1).item()
        assert images.pixels.device == CUDA and torch.all(images.pixels == start + 2).item()
        assert images.labels.device == CUDA and pair.y.device == CUDA
        batches += 1
    assert batches == len(loader) == 8
