"""What the memory probe holds back on the GPU while it tries micro-batches, as arithmetic
on a faked GPU: the training state created after it (the state of the optimizer the run
builds, measured, the gradients, DDP's buckets, the EMA's copy of the weights), headroom
under torch.compile and, for a worker with a fraction of a GPU (Tune trials sharing one),
all but its share. And that every probe pass runs while that reserve is held."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from environments import A100, make_env
from faults import build_data, build_model
from torch import nn

from raytrain_app.config import TrainConfig, config_from_dict
from raytrain_app.errors import RunFailedError
from raytrain_app.planning.rules import make_plan
from raytrain_app.protocol import ModelSpec, StepOutput
from raytrain_app.worker import memory_probe
from raytrain_app.worker.memory_probe import (
    fit_plan_to_memory,
    optimizer_state_per_param_byte,
    probe_reserve,
    training_state_bytes,
)
from raytrain_app.worker.recipe import build_optimizer

GIB = 2**30
CUDA = torch.device("cuda")  # only a name here: every CUDA query below is faked


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _plan(ema: bool, share: float = 1.0, compiled: bool = False):
    cfg = config_from_dict(
        {
            "train": {"max_batch_per_worker": "auto", "ema": {"enabled": ema}},
            "scaling": {"num_workers": 1, "gpus_per_worker": share},
            "optimizations": {"compile": compiled},
        }
    )
    return make_plan(cfg, make_env(cpus=8, gpus=1, gpu=A100))


# train.optimizer as a config gives it -> how many tensors of a parameter's size it keeps.
OPTIMIZERS = {
    "adamw": "adamw",
    "adam_amsgrad": {"target": "torch.optim:Adam", "params": {"amsgrad": True}},
    "sgd_momentum": "sgd",
    "sgd_plain": {"target": "torch.optim:SGD", "params": {}},
    "adagrad": {"target": "torch.optim:Adagrad", "params": {}},
}


def _train(optimizer: str) -> TrainConfig:
    return config_from_dict({"train": {"optimizer": OPTIMIZERS[optimizer]}}).train


def _spec(module: nn.Module) -> ModelSpec:
    return ModelSpec(module=module, step=lambda model, batch: None)


def _state_after_a_step(module: nn.Module, train: TrainConfig, plan) -> int:
    """The bytes of state the optimizer keeps for ``module`` once it has stepped."""
    optimizer = build_optimizer(module, train, plan)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    module.zero_grad(set_to_none=True)
    state = [t for s in optimizer.state.values() for t in s.values()]
    return _bytes(t for t in state if isinstance(t, torch.Tensor) and t.dim() > 0)


def _reserve_for(module: nn.Module, optimizer: str, plan) -> int:
    train = _train(optimizer)
    state = optimizer_state_per_param_byte(_spec(module), train, plan)
    return memory_probe._held_bytes(module, plan, CUDA, state)


@pytest.mark.parametrize("optimizer", [name for name in OPTIMIZERS if name != "sgd_plain"])
def test_the_reserve_grows_by_the_state_the_chosen_optimizer_keeps(gpu_of_80_gib, optimizer):
    """Before: 3.5 times the parameters' bytes for any optimizer."""
    module, plan = _model(), _plan(ema=False)
    measured = _state_after_a_step(_model(), _train(optimizer), plan)
    assert _state_after_a_step(_model(), _train("sgd_plain"), plan) == 0
    assert measured > 0
    grown = _reserve_for(module, optimizer, plan) - _reserve_for(module, "sgd_plain", plan)
    assert grown == measured


def test_sgd_without_momentum_fits_a_larger_batch_than_adam_with_amsgrad(monkeypatch):
    """The whole probe on the same model and GPU, the GPU faked: 40 MiB free, each sample
    1 MiB of activations, a 4 MiB model. Adam with amsgrad keeps three tensors per
    parameter, plain SGD none: 16 MiB held against 4 MiB (each with the gradients)."""
    mib = 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * mib, 40 * mib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    held: list[int] = []

    @contextlib.contextmanager
    def recorded(nbytes, device):
        held.append(nbytes)
        yield
        held.remove(nbytes)

    def step(model, x):
        if held[0] + x.shape[0] * mib > 40 * mib:
            raise torch.OutOfMemoryError("stand-in for the GPU running out of memory")
        return StepOutput(loss=model(x).square().mean(), num_samples=x.shape[0])

    real_held = memory_probe._held_bytes
    monkeypatch.setattr(memory_probe, "_reserve", recorded)
    # Probed on the CPU, the reserve reckoned as for the faked GPU.
    monkeypatch.setattr(memory_probe, "_held_bytes", lambda m, p, d, s: real_held(m, p, CUDA, s))
    module = nn.Linear(1024, 1024, bias=False)  # 4 MiB of float32
    plan = replace(_plan(ema=False), per_worker_batch_size=32, effective_batch_size=32)
    samples = [torch.zeros(1024)] * 32
    fits = {
        optimizer: fit_plan_to_memory(
            plan,
            ModelSpec(module=module, step=step),
            module,
            samples,
            contextlib.nullcontext,
            torch.device("cpu"),
            1,
            train=_train(optimizer),
        ).max_batch_per_worker
        for optimizer in ("adam_amsgrad", "sgd_plain")
    }
    assert fits == {"adam_amsgrad": 16, "sgd_plain": 32}


def test_under_compile_the_probe_leaves_headroom_for_the_compiled_graph(gpu_of_80_gib):
    module = _model()
    eager = memory_probe._held_bytes(module, _plan(ema=False), CUDA, 2.0)
    compiled = memory_probe._held_bytes(module, _plan(ema=False, compiled=True), CUDA, 2.0)
    assert eager < compiled < 70 * GIB  # less room for the batch, and still some


@pytest.fixture
def gpu_of_80_gib(monkeypatch):
    """An 80 GiB GPU of which 70 GiB are free, 2 GiB of them held by this process."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * GIB)


def test_the_ema_copy_of_parameters_and_buffers_is_reserved():
    module = _model()
    with_ema = training_state_bytes(module, _plan(ema=True), 2.0)
    without = training_state_bytes(module, _plan(ema=False), 2.0)
    assert with_ema - without == _bytes(module.parameters()) + _bytes(module.buffers())


def test_the_probe_holds_the_ema_when_the_plan_has_one(gpu_of_80_gib):
    # Before: the reserve left the EMA out, and a run with train.ema went out of memory
    # right after the probe's micro-batch had fitted.
    module = _model()
    held_with = memory_probe._held_bytes(module, _plan(ema=True), CUDA, 2.0)
    held_without = memory_probe._held_bytes(module, _plan(ema=False), CUDA, 2.0)
    assert held_with - held_without == _bytes(module.parameters()) + _bytes(module.buffers())


def test_a_whole_gpu_holds_back_only_the_training_state():
    assert probe_reserve(10 * GIB, 1.0, 70 * GIB, 80 * GIB, 2 * GIB, False) == 10 * GIB
    assert probe_reserve(10 * GIB, 2.0, 70 * GIB, 80 * GIB, 2 * GIB, False) == 10 * GIB


def test_a_quarter_of_a_gpu_probes_within_its_quarter():
    # 20 GiB are this trial's: 2 held already, 10 for the training state, 8 to probe in.
    held = probe_reserve(10 * GIB, 0.25, 70 * GIB, 80 * GIB, 2 * GIB, False)
    assert 70 * GIB - held == 8 * GIB


def test_a_share_that_others_already_crowd_holds_only_the_training_state():
    # 60 GiB used by other trials: less is free than the share, the GPU itself limits.
    assert probe_reserve(10 * GIB, 0.5, 20 * GIB, 80 * GIB, 2 * GIB, False) == 10 * GIB


def test_the_share_of_a_fractional_plan_is_what_the_probe_budgets(gpu_of_80_gib):
    module = _model()
    whole = memory_probe._held_bytes(module, _plan(ema=False), CUDA, 2.0)
    quarter = memory_probe._held_bytes(module, _plan(ema=False, share=0.25), CUDA, 2.0)
    assert quarter - whole == 70 * GIB - (20 * GIB - 2 * GIB)  # the free memory beyond 20 GiB


def test_no_room_left_for_a_batch_fails_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1024, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    with pytest.raises(RunFailedError, match=r"scaling.gpus_per_worker=0.25 .*; raise") as info:
        memory_probe._held_bytes(_model(), _plan(ema=True, share=0.25), CUDA, 2.0)
    assert "\n" not in str(info.value)


def test_every_probe_pass_runs_while_the_reserve_is_held(monkeypatch):
    """On CPU, the reserve recorded instead of allocated: a probe pass outside it would
    still pass the out-of-memory stand-in tests, and run out of memory on a GPU later."""
    held: list[int] = []
    passes: list[list[int]] = []
    torch.manual_seed(0)
    spec = build_model({"oom_above": 8}, {"in_features": 1})

    def step(model, batch):
        passes.append(list(held))
        return build_step(model, batch)

    build_step, spec = spec.step, replace(spec, step=step)

    @contextlib.contextmanager
    def recorded(nbytes, device):
        held.append(nbytes)
        yield
        held.remove(nbytes)

    monkeypatch.setattr(memory_probe, "_reserve", recorded)
    monkeypatch.setattr(memory_probe, "_held_bytes", lambda module, plan, device, state: 12345)
    plan = replace(_plan(ema=True), per_worker_batch_size=32, effective_batch_size=32)
    data = build_data({"num_samples": 64}, 0).train
    cpu = torch.device("cpu")
    probed = fit_plan_to_memory(
        plan, spec, spec.module, data, contextlib.nullcontext, cpu, 1, train=TrainConfig()
    )
    assert probed.per_worker_batch_size == 8
    assert len(passes) == 3 and all(during == [12345] for during in passes)  # 32, 16, 8
    assert held == []  # and given back
