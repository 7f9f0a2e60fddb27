"""EMA, gradient checkpointing, torch.compile and the plan's speed switches: each does what
it says, shown by running the worker loop in this process (one worker, no Ray)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from environments import A100, V100, make_env
from loop_harness import (
    Crash,
    LocalSession,
    assert_same_run,
    make_task,
    run_loop,
    without_timings,
)
from torch import nn

import raytrain_app as rt
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.config import config_from_dict
from raytrain_app.driver.preflight import preflight
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.errors import BadInputError, RunFailedError
from raytrain_app.models.resnet_small import ResNetSmall
from raytrain_app.models.wind_transformer import WindTransformer
from raytrain_app.planning import environment
from raytrain_app.planning.batch import PlanError
from raytrain_app.planning.rules import make_plan
from raytrain_app.worker.loop import WorkerLoop
from raytrain_app.worker.memory_probe import largest_fitting
from raytrain_app.worker.step import OptimizerStep
from raytrain_app.workloads import FactoryRef, build_data, prepare_data

EMA = {"ema": {"enabled": True, "decay": 0.9, "start_step": 5}}


# --------------------------------------------------------------------------- EMA


def test_ema_validates_with_the_average_and_is_saved_next_to_the_raw_weights(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    result, raw = run_loop(make_task(tmp_path, **EMA), session)
    newest = session.checkpoints()[0]
    ema_model = rt.load_model(newest, trust_code=True)  # auto: the EMA, which validation used
    raw_model = rt.load_model(newest, weights="raw", trust_code=True)
    assert all(torch.equal(raw_model.state_dict()[k], v) for k, v in raw.items())
    assert any(not torch.equal(ema_model.state_dict()[k], v) for k, v in raw.items())

    # The reported val_loss is the EMA weights' loss over the whole validation set.
    x, y = _validation_set(newest)
    with torch.no_grad():
        ema_loss = nn.functional.mse_loss(ema_model(x), y).item()
        raw_loss = nn.functional.mse_loss(raw_model(x), y).item()
    assert result["history"][-1]["val_loss"] == pytest.approx(ema_loss, rel=1e-6)
    assert ema_loss != pytest.approx(raw_loss, rel=1e-6)


def test_ema_follows_its_definition(tmp_path, monkeypatch):
    """One step past start_step the EMA is a copy; each later step mixes in decay."""
    task = make_task(tmp_path, epochs=1, ema={"enabled": True, "decay": 0.5, "start_step": 0})
    session = LocalSession(tmp_path / "ckpt")
    snapshots: list[dict[str, torch.Tensor]] = []
    apply = OptimizerStep.apply

    def recording_apply(stepper: OptimizerStep, step: int) -> None:
        apply(stepper, step)
        snapshots.append({k: v.clone() for k, v in stepper.module.state_dict().items()})
        if len(snapshots) == 3:
            expected = {
                k: 0.25 * snapshots[0][k] + 0.25 * snapshots[1][k] + 0.5 * snapshots[2][k]
                for k in snapshots[0]
            }
            for key, value in stepper.ema.module.state_dict().items():
                torch.testing.assert_close(value, expected[key])

    monkeypatch.setattr(OptimizerStep, "apply", recording_apply)
    WorkerLoop(task, session).run()
    assert len(snapshots) == 16


def test_ema_is_restored_exactly_on_a_mid_epoch_resume(tmp_path):
    params = {**EMA, "checkpoint_every_steps": 3}
    reference = run_loop(make_task(tmp_path / "a", **params), LocalSession(tmp_path / "a" / "c"))
    task = make_task(tmp_path / "b", **params)
    storage = tmp_path / "b" / "c"
    with pytest.raises(Crash):
        run_loop(task, LocalSession(storage, crash_after_checkpoints=4))
    resumed = run_loop(task, LocalSession(storage))
    assert_same_run(resumed, reference)  # val_loss uses the EMA: it must match too
    ours = rt.load_model(LocalSession(storage).checkpoints()[0], weights="ema", trust_code=True)
    theirs = rt.load_model(
        LocalSession(tmp_path / "a" / "c").checkpoints()[0], weights="ema", trust_code=True
    )
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def test_asking_for_ema_weights_of_a_run_without_ema_is_one_clear_error(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    run_loop(make_task(tmp_path, epochs=1), session)
    with pytest.raises(BadInputError, match=r"has no EMA weights \(ema.pt\); train with"):
        rt.load_model(session.checkpoints()[0], weights="ema", trust_code=True)


def _validation_set(checkpoint_dir):
    meta = ckpt.read_meta(checkpoint_dir)
    splits = build_data(FactoryRef(**meta["data_factory"]), meta["config"]["experiment"]["seed"])
    return splits.val.tensors


# --------------------------------------------------------------------------- checkpointing


def _saved_activations(model: nn.Module, x: torch.Tensor) -> tuple[int, dict]:
    """How many tensors autograd keeps for backward, and the gradients."""
    count = 0

    def pack(tensor):
        nonlocal count
        count += 1
        return tensor

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    return count, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("make_model", "x"),
    [
        (
            lambda: WindTransformer(num_features=4, context_length=12, horizon=3, dropout=0.0),
            torch.randn(8, 12, 4),
        ),
        (lambda: ResNetSmall(num_classes=10), torch.randn(8, 3, 16, 16)),
    ],
    ids=["wind_transformer", "resnet_small"],
)
def test_gradient_checkpointing_keeps_fewer_activations_and_changes_nothing_else(make_model, x):
    torch.manual_seed(0)
    plain = make_model().train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    plain_saved, plain_grads = _saved_activations(plain, x)
    ckpt_saved, ckpt_grads = _saved_activations(checkpointed, x)
    assert ckpt_saved < plain_saved / 2
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-6)
    # BatchNorm's running statistics took the batch in once, not again in the recompute.
    for key, value in plain.state_dict().items():
        assert torch.equal(checkpointed.state_dict()[key], value), key


def test_the_loop_turns_gradient_checkpointing_on_for_the_builtin_model(tmp_path):
    task = make_task(
        tmp_path,
        epochs=1,
        model={"name": "wind_transformer", "params": {"dropout": 0.0}},
        optimizations={"gradient_checkpointing": True},
    )
    task.config["data"] = {"name": "synthetic_wind", "params": {"num_turbines": 1}}
    task.data = prepare_data(config_from_dict(task.config).data, tmp_path / "wind-data", 3)
    loop = WorkerLoop(task, LocalSession(tmp_path / "ckpt"))
    loop.setup()
    assert loop.module.gradient_checkpointing is True


def test_a_model_without_the_hook_is_refused_before_anything_runs(tmp_path):
    cfg = config_from_dict(
        {
            "experiment": {"output_dir": str(tmp_path)},
            "model": {"target": "faults:build_model"},
            "data": {"target": "faults:build_data"},
            "optimizations": {"gradient_checkpointing": True},
            "scaling": {"num_workers": 1},
        }
    )
    plan = make_plan(cfg, make_env())
    with pytest.raises(BadInputError, match="no gradient_checkpointing_enable"):
        preflight(cfg, RunDirectory.for_config(cfg), plan)


# --------------------------------------------------------------------------- compile


def test_compiled_training_matches_eager_and_saves_plain_keys(tmp_path):
    eager, eager_weights = run_loop(
        make_task(tmp_path / "e", epochs=1), LocalSession(tmp_path / "e")
    )
    task = make_task(tmp_path / "c", epochs=1, optimizations={"compile": True})
    assert task.plan.compile
    session = LocalSession(tmp_path / "c")
    compiled, _ = run_loop(task, session)
    state = torch.load(session.checkpoints()[0] / ckpt.MODEL_FILE, weights_only=True)
    assert set(state) == set(eager_weights)  # no "_orig_mod." prefix
    torch.testing.assert_close(
        compiled["history"][-1]["train_loss"], eager["history"][-1]["train_loss"], rtol=1e-4, atol=0
    )


# --------------------------------------------------------------------------- plan


def _plan(gpu=None, **sections):
    cfg = config_from_dict({"scaling": {"num_workers": 2}, **sections})
    return make_plan(cfg, make_env(cpus=8, gpus=2 if gpu else 0, gpu=gpu))


def test_plan_turns_compile_fused_adamw_and_tf32_on_for_recent_gpus_only():
    cpu, a100, v100 = _plan(), _plan(A100), _plan(V100)
    assert (cpu.compile, cpu.fused_optimizer, cpu.tf32) == (False, False, False)
    assert (a100.compile, a100.fused_optimizer, a100.tf32) == (True, True, True)
    assert (v100.compile, v100.fused_optimizer, v100.tf32) == (False, True, False)
    assert _plan(optimizations={"compile": True}).compile
    assert not _plan(A100, optimizations={"compile": False}).compile
    # Fused wherever the optimizer class takes fused= (issue 32): SGD does, RAdam does not.
    assert _plan(A100, train={"optimizer": "sgd"}).fused_optimizer
    assert not _plan(A100, train={"optimizer": {"target": "torch.optim:RAdam"}}).fused_optimizer


def test_plan_resolves_gradient_compression_per_backend():
    assert _plan(A100, distributed={"grad_compression": "bf16"}).grad_compression == "bf16"
    assert _plan(distributed={"grad_compression": "powersgd"}).grad_compression == "powersgd"
    with pytest.raises(PlanError, match="distributed.grad_compression=fp16 needs GPUs with nccl"):
        _plan(distributed={"grad_compression": "fp16"})
    one = make_plan(
        config_from_dict(
            {"scaling": {"num_workers": 1}, "distributed": {"grad_compression": "powersgd"}}
        ),
        make_env(),
    )
    assert one.grad_compression == "none"  # one worker communicates nothing


def test_plan_shows_ema_and_gradient_checkpointing():
    plan = _plan(train=EMA, optimizations={"gradient_checkpointing": True})
    assert (plan.ema_decay, plan.ema_start_step, plan.gradient_checkpointing) == (0.9, 5, True)
    assert _plan().ema_decay is None and not _plan().gradient_checkpointing


# --------------------------------------------------------------------------- memory probe


def test_largest_fitting_halves_until_the_micro_batch_fits():
    tried = []

    def fits_up_to_12(size: int) -> None:
        tried.append(size)
        if size > 12:
            raise torch.OutOfMemoryError("out of memory")

    assert largest_fitting(fits_up_to_12, 64) == 8
    assert tried == [64, 32, 16, 8]
    with pytest.raises(RunFailedError, match="not even a micro-batch of 1"):
        largest_fitting(lambda size: fits_up_to_12(size * 100), 4)


def test_the_probe_keeps_the_global_batch_with_accumulation(tmp_path):
    """max_batch_per_worker: auto on a device where only 8 samples fit trains exactly like
    an explicit cap of 8 (CPU has no memory limit to probe, so the plan is forced here)."""
    capped = run_loop(
        make_task(
            tmp_path / "cap", epochs=1, max_batch_per_worker=8, model_params={"dropout": 0.1}
        ),
        LocalSession(tmp_path / "cap"),
    )
    task = make_task(
        tmp_path / "probe",
        epochs=1,
        max_batch_per_worker="auto",
        model_params={"dropout": 0.1, "oom_above": 8},
    )
    assert (task.plan.per_worker_batch_size, task.plan.grad_accum_steps) == (32, 1)
    task.plan = replace(task.plan, memory_probe=True)
    probed = run_loop(task, LocalSession(tmp_path / "probe"))
    assert (probed[0]["per_worker_batch_size"], probed[0]["grad_accum_steps"]) == (8, 4)
    # The same training, bit for bit (the probe's own passes left the RNG alone); the
    # validation loss only sums fp32 batch means over smaller batches.
    for key, tensor in capped[1].items():
        assert torch.equal(probed[1][key], tensor), key
    (row,) = without_timings(probed[0]["history"])
    assert row == pytest.approx(without_timings(capped[0]["history"])[0], rel=1e-6)


def test_the_loop_harness_plans_for_a_cpu_even_on_a_gpu_host(tmp_path, monkeypatch):
    """The CPU tests of this tier must train in fp32 without compile or the fused CUDA
    optimizer wherever they run, a GPU host included."""
    monkeypatch.setattr(environment, "local_gpu", lambda: A100)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    plan = make_task(tmp_path).plan
    assert (plan.use_gpu, plan.precision, plan.compile, plan.fused_optimizer) == (
        False,
        "fp32",
        False,
        False,
    )
