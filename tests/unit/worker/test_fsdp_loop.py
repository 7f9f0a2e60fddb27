"""``distributed.strategy: fsdp`` on real gloo ranks (no Ray): the worker loop with FSDP2,
checkpoints every rank writes its shards of, resumes at the same and at another world size,
clipping over the full gradient norm, and ``model.pt`` as a plain module.

One spawn of two ranks trains a DDP reference, an uninterrupted FSDP run, and an FSDP run
that crashes after a mid-epoch checkpoint and then resumes; one worker in this process
resumes a copy of that crashed run. Clipping is tight enough to act on every step, and the
EMA is on, so FSDP matching DDP shows both work on the whole model, not on shards.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_on_two_ranks
from loop_harness import TIMING_KEYS, Crash, LocalSession, make_task
from torch import nn

from raytrain_app import load_model
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.sharded import SHARDED_METADATA_FILE, full_state_dict
from raytrain_app.models.resnet_small import ResNetSmall
from raytrain_app.models.wind_transformer import WindTransformer
from raytrain_app.worker.fsdp import fsdp_blocks
from raytrain_app.worker.loop import WorkerLoop, WorkerTask

# 512 training samples, global batch 64: 8 steps per epoch, 2 epochs. Checkpoints at steps
# 3, 6, 8 (epoch end), 9, 12, 15, 16: the 4th is one step into epoch 2.
CHECKPOINT_EVERY = 3
CRASH_AFTER = 4


class CrashingSession(LocalSession):
    """One of the gloo ranks; every rank dies right after the ``crash_after``-th checkpoint
    it took part in."""

    def __init__(self, storage: Path, crash_after: int | None) -> None:
        super().__init__(storage)
        self.crash_at, self.taken = crash_after, 0

    def report(self, metrics, saved, name) -> None:
        super().report(metrics, saved, name)
        self.taken += name is not None
        if self.crash_at is not None and self.taken >= self.crash_at:
            raise Crash


def _task(root: Path, strategy: str, world_size: int) -> WorkerTask:
    task = make_task(
        root,
        checkpoint_every_steps=CHECKPOINT_EVERY,
        epochs=2,
        global_batch_size=64,
        grad_clip=0.05,  # below every step's gradient norm: clipping always acts
        ema={"enabled": True, "decay": 0.9},
        optimizer="adamw",
    )
    task.config["scaling"]["num_workers"] = world_size
    task.config["distributed"]["strategy"] = strategy
    task.plan = replace(
        task.plan,
        strategy=strategy,
        world_size=world_size,
        per_worker_batch_size=task.plan.effective_batch_size // world_size,
        grad_accum_steps=1,
        sync_batchnorm=False,
    )
    return task


def _run(task: WorkerTask, storage: Path, crash_after: int | None = None) -> dict:
    loop = WorkerLoop(task, CrashingSession(storage, crash_after))
    try:
        result = loop.run()
    except Crash:
        return {"crashed": True}
    # Every rank gathers the full weights (FSDP's all-gather); rank 0 gets them.
    weights = full_state_dict(loop.module) if dist.is_initialized() else loop.module.state_dict()
    return {"history": result["history"], "weights": weights, "sharded": _is_dtensor(loop)}


def _is_dtensor(loop: WorkerLoop) -> bool:
    return type(next(loop.module.parameters())).__name__ == "DTensor"


def _two_ranks(rank: int, root: str, tasks: dict[str, WorkerTask]) -> dict:
    torch.set_num_threads(1)
    root_path = Path(root)
    out = {
        "ddp": _run(tasks["ddp"], root_path / "ddp-ckpt"),
        "fsdp": _run(tasks["fsdp"], root_path / "fsdp-ckpt"),
    }
    crashing, storage = tasks["crash"], root_path / "crash-ckpt"
    out["crashed"] = _run(crashing, storage, CRASH_AFTER)["crashed"]
    dist.barrier()
    if rank == 0:  # the same crashed run, for a resume on one worker
        shutil.copytree(storage, root_path / "crash-ckpt-for-one")
    dist.barrier()
    out["resumed"] = _run(crashing, storage)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    # Prepared here, so that no rank writes their data.
    tasks = {
        "ddp": _task(root / "ddp", "ddp", 2),
        "fsdp": _task(root / "fsdp", "fsdp", 2),
        "crash": _task(root / "crash", "fsdp", 2),
    }
    one_task = replace(_task(root / "crash", "fsdp", 1), data=tasks["crash"].data)
    two = functools.partial(_two_ranks, root=str(root), tasks=tasks)
    ranks = run_on_two_ranks(two, root, timeout_s=120)
    assert ranks[0]["fsdp"]["sharded"] and not ranks[0]["ddp"]["sharded"]  # FSDP2's DTensors
    # One worker in this process, without a process group: DCP reshards without one.
    one = _run(one_task, root / "crash-ckpt-for-one")
    return {"root": root, "rank0": ranks[0], "one": one}


def _close(a: list[dict], b: list[dict], rel: float) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b, strict=True):
        for key in row_a.keys() - {*TIMING_KEYS, "world_size"}:  # world_size differs
            assert row_a[key] == pytest.approx(row_b[key], rel=rel, abs=1e-7), key


def test_fsdp_trains_sharded_and_matches_ddp_with_clipping_and_ema(runs):
    ddp, fsdp = runs["rank0"]["ddp"], runs["rank0"]["fsdp"]
    # Per-shard gradient norms would clip each shard differently from DDP's whole-model norm.
    _close(fsdp["history"], ddp["history"], rel=1e-4)
    for key, tensor in ddp["weights"].items():
        torch.testing.assert_close(fsdp["weights"][key], tensor, rtol=1e-4, atol=1e-6)


def test_every_rank_writes_its_shard_into_one_checkpoint(runs, tmp_path):
    checkpoints = ckpt.checkpoints_newest_first(runs["root"] / "fsdp-ckpt")
    assert [ckpt.name_progress(c.name)[1] for c in checkpoints] == [16, 15, 12, 9, 8, 6, 3]
    names = {p.name for p in checkpoints[0].iterdir()}
    assert {SHARDED_METADATA_FILE, "__0_0.distcp", "__1_0.distcp", ckpt.MODEL_FILE} <= names
    ckpt.verify_checkpoint(checkpoints[0])  # the manifest lists both ranks' shards
    torn = shutil.copytree(checkpoints[0], tmp_path / "torn")
    (torn / "__1_0.distcp").write_bytes(b"torn")
    with pytest.raises(ckpt.DamagedCheckpointError, match="__1_0.distcp"):
        ckpt.verify_checkpoint(torn)


def test_a_crashed_fsdp_run_resumes_exactly(runs):
    rank0 = runs["rank0"]
    assert rank0["crashed"] is True
    resumed, reference = rank0["resumed"], rank0["fsdp"]
    assert _without_timings(resumed) == _without_timings(reference)
    for key, tensor in reference["weights"].items():
        assert torch.equal(resumed["weights"][key], tensor), key


def _without_timings(run: dict) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in run["history"]]


def test_a_two_rank_fsdp_checkpoint_resumes_on_one_worker(runs):
    one, reference = runs["one"], runs["rank0"]["fsdp"]
    _close(one["history"], reference["history"], rel=1e-4)
    for key, tensor in reference["weights"].items():
        torch.testing.assert_close(one["weights"][key], tensor, rtol=1e-4, atol=1e-6)


def test_load_model_returns_a_plain_module_with_the_gathered_weights(runs):
    newest = ckpt.checkpoints_newest_first(runs["root"] / "fsdp-ckpt")[0]
    module = load_model(newest, weights="raw", trust_code=True)
    assert all(type(p) is nn.Parameter for p in module.parameters())
    for key, tensor in runs["rank0"]["fsdp"]["weights"].items():
        assert torch.equal(module.state_dict()[key], tensor), key
    ema = load_model(newest, trust_code=True)  # the EMA, gathered the same way
    assert all(type(p) is nn.Parameter for p in ema.parameters())
    assert not torch.equal(ema.state_dict()["0.weight"], module.state_dict()["0.weight"])


# ------------------------------------------------------------------ which modules are blocks


class _Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def fsdp_blocks(self) -> list[nn.Module]:
        return [self.b]


def test_fsdp_blocks_are_the_hook_s_else_the_repeated_layers_else_the_children():
    transformer = WindTransformer(num_features=3, context_length=4, horizon=2, num_layers=3)
    assert fsdp_blocks(transformer) == list(transformer.encoder.layers)
    resnet = ResNetSmall(num_classes=3)
    blocks = fsdp_blocks(resnet)
    assert all(block in blocks for block in resnet.blocks)  # the residual blocks, whole
    inside = [m for m in resnet.blocks[0].modules() if m is not resnet.blocks[0]]
    assert not any(m in blocks for m in inside)  # a block's own layers are not split
    hooked = _Hooked()
    assert fsdp_blocks(hooked) == [hooked.b]
    plain = nn.Module()
    plain.encoder, plain.act, plain.head = nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)
    assert fsdp_blocks(plain) == [plain.encoder, plain.head]  # parameter-holding children
