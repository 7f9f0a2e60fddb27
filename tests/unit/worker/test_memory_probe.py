"""The memory probe (``train.max_batch_per_worker: auto``) on CPU, with a stand-in for running
out of memory: it leaves the model as it found it, and ranks that run out at different
sizes probe without a collective and agree on the smallest afterwards."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from pathlib import Path

import torch
from faults import build_data, build_model
from gloo_ranks import run_on_two_ranks
from loop_harness import LocalSession, make_task

from raytrain_app.protocol import collate
from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.worker.memory_probe import probe_micro_batch
from raytrain_app.worker.sync_batchnorm import GlooSyncBatchNorm


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_the_probe_leaves_buffers_and_gradients_as_they_were():
    torch.manual_seed(0)
    spec = build_model({"batchnorm": True, "oom_above": 8}, {"in_features": 1})
    module = spec.module.eval()  # the probe trains; the module's mode comes back too
    for p in module.parameters():
        p.grad = torch.full_like(p, 0.5)  # whatever the caller had accumulated
    before = _state(module)
    dataset = build_data({"num_samples": 64}, 0).train
    fits = probe_micro_batch(
        spec, module, dataset, collate, lambda b: b, 32, contextlib.nullcontext, torch.device("cpu")
    )
    assert fits == 8
    after = module.state_dict()
    for key, value in before.items():  # BatchNorm's running statistics and batch count
        assert torch.equal(after[key], value), key
    assert not module.training
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in module.parameters())


def _probe_task(root: Path) -> WorkerTask:
    # Rank 0 runs out of memory above 16 samples, rank 1 above 8, each after its forward
    # pass: a collective inside the probe would then pair different calls across ranks.
    params = {"batchnorm": True, "oom_above": [16, 8]}
    task = make_task(root, epochs=1, max_batch_per_worker="auto", model_params=params)
    task.config["scaling"]["num_workers"] = 2
    task.plan = replace(
        task.plan,
        world_size=2,
        per_worker_batch_size=16,
        grad_accum_steps=1,
        memory_probe=True,  # CPU has no memory to probe: forced, as on a GPU
        sync_batchnorm=True,
    )
    return task


def _probe_rank(rank: int, task: WorkerTask, root: str) -> dict:
    torch.set_num_threads(1)
    loop = WorkerLoop(task, LocalSession(Path(root) / f"ckpt{rank}"))
    loop.setup()  # the probe runs here, before DDP wraps the model
    return {
        "split": (loop.plan.per_worker_batch_size, loop.plan.grad_accum_steps),
        "synced": isinstance(loop.module[1], GlooSyncBatchNorm),
        "state": loop.module.state_dict(),
    }


def test_ranks_that_run_out_at_different_sizes_agree_on_the_smallest(tmp_path):
    task = _probe_task(tmp_path)
    work = functools.partial(_probe_rank, task=task, root=str(tmp_path))
    ranks = run_on_two_ranks(work, tmp_path, timeout_s=60)
    assert [r["split"] for r in ranks] == [(8, 2), (8, 2)]  # the global batch kept
    assert all(r["synced"] for r in ranks)  # SyncBatchNorm for the training itself
    torch.manual_seed(task.config["experiment"]["seed"])
    initial = build_model(task.config["model"]["params"], {"in_features": 1}).module
    for rank in ranks:  # the probe's passes left the running statistics alone
        for key, value in initial.state_dict().items():
            assert torch.equal(rank["state"][key], value), key
