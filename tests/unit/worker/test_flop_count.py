"""FLOPs per sample and the throughput a run reports, through the worker loop in this
process (one CPU worker, no Ray): the count of a stack of Linear layers is the analytic
one, a model's own ``flops_per_sample`` wins, counting changes nothing training does, and
metrics.csv's rows and summary.json's ``throughput`` carry items/s and FLOP/s (no MFU on
CPU)."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from loop_harness import LocalSession, make_task, run_loop, without_timings
from torch import nn

from raytrain_app.driver.run_summary import _summary
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import ModelSpec, StepOutput
from raytrain_app.worker import flop_count, worker_setup
from raytrain_app.worker.flop_count import own_flops_per_sample

WIDTHS = (1, 16, 8, 4, 1)  # the sine workload's 1 input feature to 1 output


def _linear_stack_flops_per_sample() -> int:
    """What one sample costs a stack of Linear layers, forward and backward, worked out
    by hand: a Linear of i inputs and o outputs multiplies an (n x i) by an (i x o) matrix,
    2*i*o FLOPs per sample forward (bias adds and activations are not matmuls); backward
    takes as much again for its weight's gradient, and again for its input's gradient,
    except the first layer's, whose input (the data) needs none."""
    layers = list(itertools.pairwise(WIDTHS))
    forward = sum(2 * i * o for i, o in layers)
    weight_grads = forward
    input_grads = sum(2 * i * o for i, o in layers[1:])
    return forward + weight_grads + input_grads


def _build_linear_stack(params: dict, data_info: dict) -> ModelSpec:
    assert data_info["in_features"] == WIDTHS[0]
    layers: list[nn.Module] = []
    for i, o in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(i, o), nn.Tanh()]
    module = nn.Sequential(*layers[:-1])

    def step(model: nn.Module, batch) -> StepOutput:
        x, y = batch
        return StepOutput(loss=nn.functional.mse_loss(model(x), y), num_samples=len(y))

    return ModelSpec(module=module, step=step)


def test_flops_per_step_equal_the_analytic_count_for_a_stack_of_linear_layers(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(worker_setup, "build_model", _build_linear_stack)
    # 32 samples per step in 2 micro-batches of 16: the count is of one micro-batch.
    task = make_task(tmp_path, epochs=1, max_batch_per_worker=16)
    result, _ = run_loop(task, LocalSession(tmp_path / "ckpt"))
    assert (result["per_worker_batch_size"], result["grad_accum_steps"]) == (16, 2)
    throughput = result["throughput"]
    assert throughput["flops_per_sample_from"] == "counted"
    per_step = throughput["flops_per_sample"] * 16 * 2
    assert per_step == 32 * _linear_stack_flops_per_sample()
    (row,) = result["history"]
    assert row["flops_per_s_per_worker"] == pytest.approx(
        throughput["flops_per_sample"] * row["samples_per_s"]
    )


def _with_own_flops(own) -> object:
    """The faults workload, its module given a ``flops_per_sample`` of ``own``."""
    build = worker_setup.build_model

    def build_with_own(ref, data_info) -> ModelSpec:
        spec = build(ref, data_info)
        spec.module.flops_per_sample = own
        return spec

    return build_with_own


@pytest.mark.parametrize("own", [1234.0, lambda: 1234])
def test_a_models_own_flops_per_sample_wins_and_nothing_is_counted(tmp_path, monkeypatch, own):
    monkeypatch.setattr(worker_setup, "build_model", _with_own_flops(own))

    def no_counter(*args, **kwargs):
        raise AssertionError("counted although the model gives its FLOPs")

    monkeypatch.setattr(flop_count, "FlopCounterMode", no_counter)
    result, _ = run_loop(make_task(tmp_path, epochs=1), LocalSession(tmp_path / "ckpt"))
    throughput = result["throughput"]
    assert (throughput["flops_per_sample"], throughput["flops_per_sample_from"]) == (
        1234.0,
        "model",
    )


@pytest.mark.parametrize("bad", [0, -5.0, "many", True, lambda: None])
def test_a_flops_per_sample_that_is_not_a_positive_number_is_one_line(bad):
    module = nn.Linear(2, 2)
    module.flops_per_sample = bad
    with pytest.raises(BadInputError, match=r"^the model's flops_per_sample is .*; make it"):
        own_flops_per_sample(module)


def test_counting_changes_nothing_training_does(tmp_path, monkeypatch):
    # Dropout draws from the random streams and BatchNorm keeps running statistics: a
    # count that ran an extra pass, or disturbed either, would change the run.
    params = {"dropout": 0.2, "batchnorm": True}
    counted = run_loop(
        make_task(tmp_path / "a", epochs=2, model_params=params), LocalSession(tmp_path / "ca")
    )
    monkeypatch.setattr(worker_setup, "build_model", _with_own_flops(10.0))
    uncounted = run_loop(
        make_task(tmp_path / "b", epochs=2, model_params=params), LocalSession(tmp_path / "cb")
    )
    assert counted[0]["throughput"]["flops_per_sample_from"] == "counted"
    assert uncounted[0]["throughput"]["flops_per_sample_from"] == "model"
    assert without_timings(counted[0]["history"]) == without_timings(uncounted[0]["history"])
    for key, tensor in counted[1].items():
        assert torch.equal(tensor, uncounted[1][key]), key


def test_counting_leaves_every_gradient_as_it_is_uncounted_silu_included():
    """torch's counter computes ops it has no formula for through their decomposition:
    SiLU's backward (every Llama MLP) then rounded otherwise, and the counted micro-batch,
    as every resumed run's first, trained differently."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 128), nn.SiLU(), nn.Linear(128, 32), nn.GELU())
    x = torch.randn(8, 40, 32)

    def gradients(counted: bool) -> tuple[list[torch.Tensor], float | None]:
        mlp.zero_grad()
        flops = flop_count.FlopsPerSample(mlp, micro_batch=8)
        with flops.counting() if counted else contextlib.nullcontext():
            mlp(x).square().mean().backward()
        return [p.grad.clone() for p in mlp.parameters()], flops.value

    plain, _ = gradients(counted=False)
    counted, per_sample = gradients(counted=True)
    for a, b in zip(plain, counted, strict=True):
        assert torch.equal(a, b)
    # The matmuls' count as before: 2 Linear layers, forward, weight and input gradients
    # (the data needs none), 2 * 40 positions * 32 * 128 FLOPs each.
    assert per_sample == 5 * 2 * 40 * 32 * 128


def _counting_tokens(build):
    """The workload's step, its loss a mean over 3 "tokens" per sample."""

    def build_tokens(ref, data_info) -> ModelSpec:
        spec = build(ref, data_info)

        def step(model, batch) -> StepOutput:
            out = spec.step(model, batch)
            return replace(out, num_samples=3 * out.num_samples)

        return replace(spec, step=step)

    return build_tokens


def test_a_run_reports_items_per_s_from_the_steps_counts_and_flops_without_mfu_on_cpu(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(worker_setup, "build_model", _counting_tokens(worker_setup.build_model))
    task = make_task(tmp_path, epochs=2)
    result, _ = run_loop(task, LocalSession(tmp_path / "ckpt"))
    history = result["history"]
    for row in history:
        assert row["items_per_s"] == pytest.approx(3 * row["samples_per_s"])
        assert row["flops_per_s_per_worker"] > 0 and "mfu" not in row
    throughput = result["throughput"]
    seconds = sum(row["epoch_time_s"] for row in history)
    items = sum(row["items_per_s"] * row["epoch_time_s"] for row in history)
    assert throughput["items_per_s"] == pytest.approx(items / seconds)
    assert throughput["flops_per_s_per_worker"] > 0
    assert (throughput["mfu"], throughput["peak"], throughput["peak_flops_per_s"]) == (
        None,
        None,
        None,
    )
    # The driver writes what the workers returned into summary.json.
    returned = SimpleNamespace(return_value=result, checkpoint=None)
    assert _summary(returned, task.plan, 1.0, None)["throughput"] == throughput


def test_attention_on_cpu_is_counted_as_torch_counts_it_on_a_gpu():
    # torch's counter knows the GPU kernels of scaled_dot_product_attention, not the CPU
    # one. Its formula: 2 batched matmuls forward (scores, then values), 5 backward (the
    # flash kernel recomputes the scores), each 2*s*s*d FLOPs per batch and head.
    b, h, s, d = 2, 4, 16, 8
    q = torch.randn(b, h, s, d, requires_grad=True)
    flops = flop_count.FlopsPerSample(nn.Identity(), micro_batch=b)
    with flops.counting():
        nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    assert flops.value * b == 7 * 2 * b * h * s * s * d
