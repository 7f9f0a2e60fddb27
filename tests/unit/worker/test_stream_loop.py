"""Streaming Parquet data trains the same optimisation on 1 and 2 workers and across resumes.

The worker loop runs in this process (1 worker) and on two real gloo ranks (no Ray), over
data prepared once with ``data.streaming: true``: three series of very different lengths.
Each rank records the window ids of every step (``StreamBatches.record_ids``), so the test
compares what trained, not only where it ended:
- 1 and 2 workers take the same windows at every step of two epochs, run the same number of
  steps on both ranks, report the same validation metrics, and end at the same weights;
- a 1-worker run stopped mid-epoch resumes on 1 worker and on 2 workers with the very ids
  and weights of the uninterrupted run.
"""

from __future__ import annotations

import functools
import shutil
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from gloo_ranks import run_on_two_ranks
from loop_harness import TIMING_KEYS, Crash, LocalSession, run_loop, worker_task

from raytrain_app.config import config_from_dict
from raytrain_app.data.stream_windows import FACTORY
from raytrain_app.worker.loop import WorkerTask
from raytrain_app.worker.stream_batches import StreamBatches

# Skewed series: lanes cut across them, and every rank must still run the same steps.
SERIES_LENGTHS = {"t1": 1300, "t2": 140, "t3": 520}
CHECKPOINT_EVERY = 7  # mid-epoch checkpoints: the resumes start inside an epoch


def _write_data(path: Path) -> None:
    rng = np.random.default_rng(0)
    parts = []
    for turbine, length in SERIES_LENGTHS.items():
        t = np.arange(length)
        wind = 8 + 3 * np.sin(t / 17) + rng.normal(0, 0.3, length)
        parts.append(
            pa.table(
                {
                    "turbine": [turbine] * length,
                    "time": t,
                    "wind": wind,
                    "power": 0.5 * wind**2 + rng.normal(0, 0.5, length),
                }
            )
        )
    table = pa.concat_tables(parts)
    # Rows out of order: the prepare pass sorts each series by time.
    pq.write_table(table.take(rng.permutation(table.num_rows)), path)


def _config(root: Path, workers: int, name: str) -> dict:
    return {
        "experiment": {"name": name, "output_dir": str(root / "runs"), "seed": 5},
        "data": {
            "path": str(root / "wind.parquet"),
            "streaming": True,
            "cache_dir": str(root / "cache"),
            "params": {
                "feature_columns": ["wind"],
                "target_column": "power",
                "group_column": "turbine",
                "time_column": "time",
                "context_length": 12,
                "horizon": 4,
                "val_fraction": 0.25,
            },
        },
        "model": {"params": {"d_model": 16, "nhead": 2, "num_layers": 1, "dropout": 0.0}},
        "train": {
            "epochs": 2,
            "global_batch_size": 32,
            "lr": 3e-3,
            "checkpoint_every_steps": CHECKPOINT_EVERY,
        },
        "scaling": {"num_workers": workers, "use_gpu": False},
        "distributed": {"backend": "gloo"},
        "precision": "fp32",
        "dataloader": {"num_workers": 0},
    }


def _task(root: Path, workers: int, name: str) -> WorkerTask:
    cfg = config_from_dict(_config(root, workers, name))
    task = worker_task(cfg, root / "runs" / name)
    assert task.data.target == FACTORY  # streamed, not loaded
    return task


def _recording_run(task: WorkerTask, session: LocalSession) -> dict:
    StreamBatches.record_ids = []
    try:
        result, weights = run_loop(task, session)
        crashed = False
    except Crash:
        result, weights, crashed = None, None, True
    # Plain values: the gloo ranks hand their results back through torch.save.
    ids = [(epoch, step, ids.tolist()) for epoch, step, ids in StreamBatches.record_ids]
    StreamBatches.record_ids = None
    return {"result": result, "weights": weights, "ids": ids, "crashed": crashed}


def _rank(rank: int, tasks: list[tuple[WorkerTask, str]], root: str) -> list[dict]:
    torch.set_num_threads(1)
    return [_recording_run(task, LocalSession(Path(root) / ckpt)) for task, ckpt in tasks]


def _by_step(records: list[tuple[int, int, list[int]]]) -> dict[tuple[int, int], list[int]]:
    steps: dict[tuple[int, int], list[int]] = defaultdict(list)
    for epoch, step, ids in records:
        steps[(epoch, step)].extend(ids)
    return {key: sorted(ids) for key, ids in steps.items()}


def _close_history(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b, strict=True):
        for key in row_a.keys() - {*TIMING_KEYS, "world_size"}:
            assert row_a[key] == pytest.approx(row_b[key], rel=1e-4, abs=1e-6), key


def _close_weights(a: dict, b: dict) -> None:
    for key, tensor in a.items():
        other = b[key]
        if key.endswith("self_attn.in_proj_bias"):
            # Leave out the key projection's bias: softmax ignores it, so its gradient is
            # rounding noise, which AdamW's normalised steps turn into updates of lr size.
            third = tensor.shape[0] // 3
            tensor = torch.cat([tensor[:third], tensor[2 * third :]])
            other = torch.cat([other[:third], other[2 * third :]])
        torch.testing.assert_close(other, tensor, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run, trained once: 1 worker whole, stopped and resumed on 1; on two gloo
    ranks, 2 workers whole and the stopped 1-worker run resumed on 2."""
    root = tmp_path_factory.mktemp("stream")
    _write_data(root / "wind.parquet")
    one = _recording_run(_task(root, 1, "one"), LocalSession(root / "ckpt-one"))
    stopped_dir = root / "ckpt-stopped"
    stopped = _recording_run(_task(root, 1, "stopped"), LocalSession(stopped_dir, 2))
    assert stopped["crashed"]
    shutil.copytree(stopped_dir, root / "ckpt-resumed-on-2")
    resumed_on_1 = _recording_run(_task(root, 1, "stopped"), LocalSession(stopped_dir))
    two_task = _task(root, 2, "two")
    # The stopped run's task at 2 workers: the same run directory and data, re-split.
    resume_task = replace(two_task, run_dir=str(root / "runs" / "stopped"))
    work = functools.partial(
        _rank, tasks=[(two_task, "ckpt-two"), (resume_task, "ckpt-resumed-on-2")], root=str(root)
    )
    ranks = run_on_two_ranks(work, root)
    return {
        "one": one,
        "stopped": stopped,
        "resumed_on_1": resumed_on_1,
        "two": [r[0] for r in ranks],
        "resumed_on_2": [r[1] for r in ranks],
    }


def test_one_and_two_workers_train_the_same_windows_at_every_step(runs):
    one = _by_step(runs["one"]["ids"])
    ranks = [_by_step(r["ids"]) for r in runs["two"]]
    assert len(one) > 2 * 10 and {epoch for epoch, _ in one} == {0, 1}
    # Every rank ran every step (equal step counts, whatever the series lengths) ...
    assert set(ranks[0]) == set(ranks[1]) == set(one)
    for key, ids in one.items():
        # ... with half of the global batch each, together the 1-worker run's windows.
        assert len(ranks[0][key]) == len(ranks[1][key]) == 16
        assert sorted(ranks[0][key] + ranks[1][key]) == ids
    epochs = [
        sorted(i for (e, _), step in one.items() if e == epoch for i in step) for epoch in (0, 1)
    ]
    assert len(set(epochs[0])) == len(epochs[0])  # no window twice in an epoch
    assert [k for k in one if k[0] == 0] != [] and one[(0, 0)] != one[(1, 0)]  # reshuffled


def test_one_and_two_workers_end_alike_and_validate_every_window_once(runs):
    one = runs["one"]["result"]
    for rank in runs["two"]:
        _close_history(rank["result"]["history"], one["history"])
        _close_weights(runs["one"]["weights"], rank["weights"])
    # val_loss is a global mean over every validation window, however they were shared.
    assert [r["val_loss"] for r in runs["two"][0]["result"]["history"]] == pytest.approx(
        [r["val_loss"] for r in one["history"]], rel=1e-5
    )
    losses = [row["train_loss"] for row in one["history"]]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("resumed", ["resumed_on_1", "resumed_on_2"])
def test_a_stopped_run_resumes_with_the_same_windows_and_weights(runs, resumed):
    reference = _by_step(runs["one"]["ids"])
    before = _by_step(runs["stopped"]["ids"])
    records = runs[resumed] if resumed == "resumed_on_1" else None
    if records is not None:
        after, result, weights = _by_step(records["ids"]), records["result"], records["weights"]
    else:
        ranks = runs[resumed]
        merged = [_by_step(r["ids"]) for r in ranks]
        after = {k: sorted(merged[0][k] + merged[1][k]) for k in merged[0]}
        result, weights = ranks[0]["result"], ranks[0]["weights"]
    first_after = min(after)
    assert first_after[1] > 0  # the resume started inside an epoch
    # Nothing repeated or skipped: the steps before the stop and after the resume are the
    # uninterrupted run's, each with its very windows.
    assert {**{k: v for k, v in before.items() if k < first_after}, **after} == reference
    _close_history(result["history"], runs["one"]["result"]["history"])
    _close_weights(runs["one"]["weights"], weights)
