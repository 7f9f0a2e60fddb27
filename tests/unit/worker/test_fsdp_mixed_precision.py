"""FSDP2 under bf16 on two real gloo ranks: parameters all-gathered and computed in bf16,
gradients reduce-scattered in fp32 into the fp32 shards the optimizer steps; fp32 runs
without casts. Every collective FSDP issues is recorded with its dtype."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from gloo_ranks import run_on_two_ranks
from torch import nn

from raytrain_app.worker.fsdp import shard_model_and_ema

_COLLECTIVES = ("all_gather_single", "reduce_scatter_single")


@contextlib.contextmanager
def _recorded_collectives() -> Iterator[dict[str, set[str]]]:
    """While the block runs, the two collectives FSDP2 calls (``torch.distributed``'s,
    looked up on each call) record the dtype each moves."""
    seen: dict[str, set[str]] = {name: set() for name in _COLLECTIVES}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def recorder(name: str):
        def record(*args, **kwargs):
            tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            seen[name].add(str(tensor.dtype))
            return originals[name](*args, **kwargs)

        return record

    for name in _COLLECTIVES:
        setattr(dist, name, recorder(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _sharded_step(rank: int, precision: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, ema = shard_model_and_ema(model, 0.9, torch.device("cpu"), precision)
    computed: set[str] = set()
    # Registered after FSDP's own pre-forward hook, which unshards: sees what computes.
    model[0].register_forward_pre_hook(lambda m, args: computed.add(str(m.weight.dtype)))
    torch.manual_seed(rank)
    with _recorded_collectives() as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(torch.randn(4, 8)).float().square().mean()
        loss.backward()
        ema.module(torch.randn(2, 8))  # the EMA's shards gather like the model's
    return {
        "gathered": sorted(seen["all_gather_single"]),
        "reduced": sorted(seen["reduce_scatter_single"]),
        "computed": sorted(computed),
        "shards": sorted({str(p.dtype) for p in model.parameters()}),
        "grads": sorted({str(p.grad.dtype) for p in model.parameters()}),
    }


def _both_precisions(rank: int) -> dict:
    return {precision: _sharded_step(rank, precision) for precision in ("bf16", "fp32")}


def test_under_bf16_fsdp_gathers_bf16_and_reduces_fp32_and_fp32_casts_nothing(tmp_path):
    # One spawn for both precisions: starting two ranks costs most of the test's time.
    for rank in run_on_two_ranks(_both_precisions, tmp_path, timeout_s=120):
        bf16, fp32 = rank["bf16"], rank["fp32"]
        assert bf16["gathered"] == ["torch.bfloat16"]  # half the bytes of fp32
        assert bf16["computed"] == ["torch.bfloat16"]
        assert bf16["reduced"] == ["torch.float32"]  # gradients summed in fp32
        assert bf16["shards"] == bf16["grads"] == ["torch.float32"]  # what AdamW steps
        assert fp32["gathered"] == fp32["reduced"] == fp32["computed"] == ["torch.float32"]
