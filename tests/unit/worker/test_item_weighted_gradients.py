"""Item-weighted gradients (issue 39): where the loss is a mean over a varying number of
items (real tokens of padded sequences, nodes of batched graphs), 1 worker, 1 worker with 2
micro-batches and 2 gloo workers (no Ray) train the same weights to float rounding, and a
step returning the summed loss (``loss_reduction="sum"``) trains what the mean does; a
token-weighted run resumes mid-epoch exactly."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_two_ranks
from loop_harness import (
    Crash,
    LocalSession,
    assert_same_run,
    run_loop,
    without_timings,
    worker_task,
)

from raytrain_app.config import config_from_dict
from raytrain_app.worker.loop import WorkerLoop, WorkerTask

WORKLOADS = {
    "tokens": ("item_counts:build_tokens", "item_counts:build_tagger"),
    "graphs": ("item_counts:build_graphs", "item_counts:build_node_regressor"),
}
# Float rounding (measured 1.2e-7), summed in different orders over 16 Adam steps; the
# unweighted mean of per-micro-batch means put these runs 4.7e-2 to 7.9e-2 apart.
ROUNDING = 1e-6


def _task(
    root: Path, workload: str, world_size: int = 1, micro: int | None = None, **params
) -> WorkerTask:
    train = params.pop("train", {})
    data, model = WORKLOADS[workload]
    raw = {
        "experiment": {"name": "items", "output_dir": str(root / "runs"), "seed": 5},
        "model": {"target": model, "params": params},
        "data": {"target": data, "params": {}},
        "train": {
            "epochs": 2,
            "global_batch_size": 16,
            "lr": 0.02,
            "max_batch_per_worker": micro,
            **train,
        },
        "scaling": {"num_workers": world_size},
        "distributed": {"backend": "gloo"},
        "dataloader": {"num_workers": 0},
    }
    return worker_task(config_from_dict(raw), root / "runs" / "items")


def _two_rank_runs(rank: int, tasks: dict[str, WorkerTask], root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, task in tasks.items():
        loop = WorkerLoop(task, LocalSession(Path(root) / f"{name}-{rank}"))
        result = loop.run()
        out[name] = {"history": result["history"], "weights": loop.module.state_dict()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every workload trained each way: name -> {"history", "weights"}."""
    root = tmp_path_factory.mktemp("items")
    torch.set_num_threads(1)
    out = {}
    for workload in WORKLOADS:
        for name, micro, params in (
            ("one", None, {}),
            ("micro", 8, {}),
            ("micro_sum", 8, {"reduction": "sum"}),
        ):
            task = _task(root / f"{workload}-{name}", workload, micro=micro, **params)
            result, weights = run_loop(task, LocalSession(root / f"{workload}-{name}-c"))
            assert result["grad_accum_steps"] == (2 if micro else 1)
            out[f"{workload}/{name}"] = {"history": result["history"], "weights": weights}
    tasks = {
        f"{workload}/{name}": _task(root / f"{workload}-{name}", workload, 2, **params)
        for workload in WORKLOADS
        for name, params in (("two", {}), ("two_sum", {"reduction": "sum"}))
    }
    ranks = run_on_two_ranks(functools.partial(_two_rank_runs, tasks=tasks, root=str(root)), root)
    for rank in ranks:  # both ranks hold the same weights and report the same rows
        for name, run in rank.items():
            assert without_timings(run["history"]) == without_timings(ranks[0][name]["history"])
            for key, tensor in run["weights"].items():
                assert torch.equal(tensor, ranks[0][name]["weights"][key])
    out.update(ranks[0])
    return out


def _farthest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[key] - b[key]).abs().max()) for key in a)


def _assert_same_training(runs: dict, a: str, b: str) -> None:
    assert _farthest(runs[a]["weights"], runs[b]["weights"]) < ROUNDING, (a, b)
    for row_a, row_b in zip(runs[a]["history"], runs[b]["history"], strict=True):
        for key in ("train_loss", "val_loss"):
            assert row_a[key] == pytest.approx(row_b[key], rel=1e-5), (a, b, key)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_one_worker_two_micro_batches_and_two_workers_train_the_same_weights(runs, workload):
    """The loss is a mean over real tokens (a tensor count) or over nodes (an int count)."""
    assert runs[f"{workload}/one"]["weights"].keys() == runs[f"{workload}/two"]["weights"].keys()
    _assert_same_training(runs, f"{workload}/one", f"{workload}/micro")
    _assert_same_training(runs, f"{workload}/one", f"{workload}/two")


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("split", ["micro", "two"])
def test_a_summed_loss_with_its_count_trains_what_the_mean_does(runs, workload, split):
    _assert_same_training(runs, f"{workload}/{split}", f"{workload}/{split}_sum")


def test_a_token_weighted_run_resumes_mid_epoch_exactly(tmp_path):
    every = {"train": {"checkpoint_every_steps": 3}}  # 8 steps per epoch
    reference = run_loop(
        _task(tmp_path / "a", "tokens", micro=8, **every), LocalSession(tmp_path / "ac")
    )
    task, storage = _task(tmp_path / "b", "tokens", micro=8, **every), tmp_path / "bc"
    with pytest.raises(Crash):  # step 9: 1 step into epoch 2, its token-weighted sums saved
        run_loop(task, LocalSession(storage, crash_after_checkpoints=4))
    assert_same_run(run_loop(task, LocalSession(storage)), reference)
