"""A run checkpointed mid-epoch by 2 workers continues on 1.

The global batch is the user's number and a global step covers the same samples for any
world size, so the resumed run ends where the 2-worker run ends, up to float rounding:
the epoch that was cut holds both ranks' sums, and no sample is skipped or seen twice.
Two real gloo processes (no Ray) write the checkpoint; the run directory's check allows
the new number of workers.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_two_ranks
from log_lines import log_lines
from loop_harness import TIMING_KEYS, Crash, LocalSession, make_task, run_loop

from raytrain_app.config import config_from_dict
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.errors import BadInputError
from raytrain_app.worker.loop import WorkerLoop, WorkerTask

CHECKPOINT_EVERY = 5
# 16 steps per epoch: checkpoints at steps 5, 10, 15, 16 (epoch end), 20, ... The 5th is
# 4 steps into epoch 2.
CRASH_AFTER = 5


class TwoRankSession(LocalSession):
    """One of two gloo ranks (rank and DDP from the process group), rank 0 persists the
    checkpoints, both crash together."""

    def __init__(self, storage: Path, crash_after: int | None) -> None:
        super().__init__(storage)
        assert self.world_size == 2
        self.crash_after_named = crash_after
        self.named = 0

    def report(self, metrics, saved, name) -> None:
        super().report(metrics, saved, name)
        self.named += name is not None  # every rank is told when a checkpoint is taken
        if self.crash_after_named is not None and self.named >= self.crash_after_named:
            raise Crash


def _task(root: Path, world_size: int) -> WorkerTask:
    task = make_task(root, checkpoint_every_steps=CHECKPOINT_EVERY)
    task.config["scaling"]["num_workers"] = world_size
    task.plan = replace(
        task.plan,
        world_size=world_size,
        per_worker_batch_size=task.plan.effective_batch_size // world_size,
        grad_accum_steps=1,
    )
    return task


def _two_worker_runs(reference: WorkerTask, crashing: WorkerTask, root: Path) -> list[dict]:
    """On two gloo ranks (one spawn), an uninterrupted run of ``reference``, then a run of
    ``crashing`` that dies after its CRASH_AFTER-th checkpoint. The tasks are prepared here,
    so no rank writes their data."""
    work = functools.partial(_rank, tasks=(reference, crashing), root=str(root))
    return run_on_two_ranks(work, root)


def _rank(rank: int, tasks: tuple[WorkerTask, WorkerTask], root: str) -> dict:
    torch.set_num_threads(1)
    reference, crashing = tasks
    loop = WorkerLoop(reference, TwoRankSession(Path(root) / "ref-ckpt", None))
    result = loop.run()
    try:
        WorkerLoop(crashing, TwoRankSession(Path(crashing.run_dir) / "ckpt", CRASH_AFTER)).run()
        crashed = False
    except Crash:
        crashed = True
    return {"history": result["history"], "weights": loop.module.state_dict(), "crashed": crashed}


def _close(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a.keys() == row_b.keys()
        for key in row_a.keys() - {*TIMING_KEYS, "world_size"}:  # world_size differs
            assert row_a[key] == pytest.approx(row_b[key], rel=1e-4, abs=1e-6), key


def test_a_two_worker_checkpoint_resumes_on_one_worker_and_ends_where_two_would(tmp_path):
    resumed_task = _task(tmp_path / "resumed", world_size=1)
    ranks = _two_worker_runs(_task(tmp_path / "ref", 2), _task(tmp_path / "resumed", 2), tmp_path)
    assert [r["crashed"] for r in ranks] == [True, True]
    reference = ranks[0]
    storage = Path(resumed_task.run_dir) / "ckpt"

    with log_lines("raytrain_app") as lines:
        result, weights = run_loop(resumed_task, LocalSession(storage))
    log = "\n".join(lines)
    assert "written by 2 workers, this run has 1" in log
    assert "at epoch 2, step 20" in log

    # Mid-epoch 2, so that epoch's train_loss needs both ranks' sums from before the cut.
    assert [row["step"] for row in result["history"]] == [16, 32, 48]
    assert [row["world_size"] for row in result["history"]] == [2, 1, 1]
    assert result["world_size_segments"] == [[0, 2], [20, 1]]
    _close(result["history"], reference["history"])
    for key, tensor in reference["weights"].items():
        torch.testing.assert_close(weights[key], tensor, rtol=1e-4, atol=1e-6)


def test_the_run_directory_lets_the_number_of_workers_change_and_nothing_that_trains(tmp_path):
    def resolved(*overrides: str):
        data = {
            "experiment": {"name": "exp1", "output_dir": str(tmp_path / "runs")},
            "scaling": {"num_workers": 2, "use_gpu": False},
            "distributed": {"strategy": "ddp", "backend": "gloo", "sync_batchnorm": True},
            "precision": "fp32",
            "dataloader": {"num_workers": 0, "pin_memory": False},
        }
        return config_from_dict(data, overrides)

    run = RunDirectory.for_config(resolved())
    run.write_config(resolved())
    # What one worker resolves to: no SyncBatchNorm, its CPUs and loader processes.
    fewer = resolved(
        "scaling.num_workers=1",
        "distributed.sync_batchnorm=false",
        "scaling.cpus_per_worker=2",
        "dataloader.num_workers=1",
    )
    assert run.check_resumable(fewer) is True
    for changed in ("train.global_batch_size=96", "precision=bf16", "scaling.use_gpu=true"):
        with pytest.raises(BadInputError, match=changed.split("=")[0]):
            run.check_resumable(resolved(changed))
