"""SyncBatchNorm: the plan's choice, and on CPU two real gloo processes (no Ray) that
normalise exactly as one process over both batches."""

from __future__ import annotations

import pytest
import torch
from environments import make_env
from gloo_ranks import run_on_two_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_app.config import ConfigError, config_from_dict
from raytrain_app.planning.plan_text import format_plan as _format_plan
from raytrain_app.planning.rules import make_plan, resolve_config
from raytrain_app.worker.sync_batchnorm import (
    GlooSyncBatchNorm,
    convert_sync_batchnorm,
    has_batchnorm,
)

STEPS = 3
PER_RANK = 4


def _inputs() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The global batch of every step, the loss weights, and the layer's initial state."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, 2 * PER_RANK, 3, 5, 5, generator=generator) * 2 + 1
    weights = torch.randn(STEPS, 2 * PER_RANK, 3, 5, 5, generator=generator)
    state = {
        "weight": torch.rand(3, generator=generator) + 0.5,
        "bias": torch.randn(3, generator=generator),
    }
    return x, weights, state


def _run_steps(model: nn.Module, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> dict:
    """Forward and backward a weighted sum of the outputs; collect what a rank computed."""
    outputs, input_grads = [], []
    for step in range(STEPS):
        inputs = x[step].clone().requires_grad_()
        out = model(inputs)
        (out * weights[step]).sum().backward()
        outputs.append(out.detach())
        input_grads.append(inputs.grad)
    return {
        "out": torch.stack(outputs),
        "input_grad": torch.stack(input_grads),
        "weight_grad": layer.weight.grad,
        "bias_grad": layer.bias.grad,
        "running_mean": layer.running_mean,
        "running_var": layer.running_var,
        "num_batches_tracked": layer.num_batches_tracked,
    }


def _batchnorm() -> nn.BatchNorm2d:
    _, _, state = _inputs()
    layer = nn.BatchNorm2d(3)
    layer.load_state_dict(state, strict=False)
    return layer


def _rank_steps(rank: int) -> dict:
    # Wrapped as the loop does: DDP must accept the converted CPU module.
    model = DistributedDataParallel(
        convert_sync_batchnorm(nn.Sequential(_batchnorm()), torch.device("cpu"))
    )
    layer = model.module[0]
    assert isinstance(layer, GlooSyncBatchNorm)
    x, weights, _ = _inputs()
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return _run_steps(model, layer, x[:, part], weights[:, part])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_on_two_ranks(_rank_steps, tmp_path_factory.mktemp("sync_bn"))


@pytest.fixture(scope="module")
def one_process() -> dict:
    x, weights, _ = _inputs()
    layer = _batchnorm()
    return _run_steps(layer, layer, x, weights)


def test_two_synced_ranks_normalise_like_one_process_over_both_batches(two_ranks, one_process):
    out = torch.cat([r["out"] for r in two_ranks], dim=1)
    torch.testing.assert_close(out, one_process["out"], rtol=1e-5, atol=1e-5)
    input_grad = torch.cat([r["input_grad"] for r in two_ranks], dim=1)
    torch.testing.assert_close(input_grad, one_process["input_grad"], rtol=1e-4, atol=1e-5)
    # DDP averages the ranks' parameter gradients; one process has their sum.
    for key in ("weight_grad", "bias_grad"):
        assert torch.equal(two_ranks[0][key], two_ranks[1][key])
        torch.testing.assert_close(2 * two_ranks[0][key], one_process[key], rtol=1e-5, atol=1e-5)


def test_running_statistics_are_identical_on_both_ranks_and_global(two_ranks, one_process):
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(two_ranks[0][key], two_ranks[1][key]), key
        torch.testing.assert_close(two_ranks[0][key], one_process[key], rtol=1e-5, atol=1e-6)


def test_unsynced_halves_would_give_other_statistics(one_process):
    x, weights, _ = _inputs()
    layer = _batchnorm()
    half = _run_steps(layer, layer, x[:, :PER_RANK], weights[:, :PER_RANK])
    assert not torch.allclose(half["running_var"], one_process["running_var"], rtol=1e-3)


def test_conversion_keeps_state_dict_keys_and_values():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_sync_batchnorm(model, torch.device("cpu"))
    assert converted is model
    assert [type(m) for m in (model[1], model[2][0])] == [GlooSyncBatchNorm] * 2
    after = converted.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)))
    plain.load_state_dict(after)  # strict: a checkpoint of the synced model fits the plain one


def test_cuda_gets_torchs_own_sync_batchnorm():
    model = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), torch.device("cuda"))
    # torch's layer (its CUDA kernels, and what DDP expects), synced outside compile
    assert isinstance(model[0], nn.SyncBatchNorm)
    assert list(model.state_dict()) == list(nn.Sequential(nn.BatchNorm2d(4)).state_dict())


def test_without_a_process_group_it_is_plain_batchnorm():
    x = torch.randn(6, 3, 4, 4)
    synced, plain = convert_sync_batchnorm(_batchnorm(), torch.device("cpu")), _batchnorm()
    assert torch.equal(synced(x), plain(x))
    assert torch.equal(synced.running_var, plain.running_var)
    synced.eval(), plain.eval()
    assert torch.equal(synced(x), plain(x))


def test_has_batchnorm():
    assert has_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert not has_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))


# --------------------------------------------------------------------------- config and plan


@pytest.mark.parametrize(
    ("workers", "requested", "strategy", "expected"),
    [
        (2, "auto", "auto", True),  # DDP over 2 workers: synced
        (1, "auto", "auto", False),  # nothing to sync with
        (1, "auto", "single", False),
        (1, True, "auto", True),  # explicit choices win
        (2, False, "auto", False),
        (2, True, "ddp", True),
    ],
)
def test_plan_resolves_sync_batchnorm(workers, requested, strategy, expected):
    cfg = config_from_dict(
        {
            "scaling": {"num_workers": workers},
            "distributed": {"sync_batchnorm": requested, "strategy": strategy},
        }
    )
    plan = make_plan(cfg, make_env(cpus=2))
    assert plan.sync_batchnorm is expected
    assert plan.to_dict()["sync_batchnorm"] is expected  # raytrain plan --json
    assert f"SyncBatchNorm {'on' if expected else 'off'}" in _format_plan(make_env(cpus=2), plan)
    # The run directory's config.yaml holds the decision, not "auto".
    assert resolve_config(cfg, plan).distributed.sync_batchnorm is expected


def test_sync_batchnorm_takes_auto_or_a_boolean():
    assert config_from_dict({}).distributed.sync_batchnorm == "auto"
    with pytest.raises(ConfigError, match="distributed.sync_batchnorm"):
        config_from_dict({"distributed": {"sync_batchnorm": "yes"}})
