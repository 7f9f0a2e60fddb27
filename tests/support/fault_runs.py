"""Runs that are interrupted and resumed, compared with one uninterrupted run.

Shared by tests/distributed/test_faults.py and tests/distributed/test_signals.py: the
``faults`` workload's config, ``raytrain train`` as a subprocess with its own embedded Ray,
waiting for a checkpoint (never a fixed sleep), and the bit-for-bit comparison.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch
from paths import EXAMPLES, TEST_WORKLOADS

import raytrain_app as rt
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.tracking.metrics_log import TIMING_COLUMNS, read_metrics


def fault_config(output_dir: Path, name: str, epochs: int = 4, **model_params) -> dict:
    """Sine regression with dropout, odd-sized splits and a checkpoint every 10 steps;
    2 workers, 50 optimizer steps per epoch."""
    return {
        "experiment": {"name": name, "output_dir": str(output_dir), "seed": 5},
        "model": {"target": "faults:build_model", "params": {"dropout": 0.1, **model_params}},
        # 2002 samples: 1601 train and 401 validation, neither divisible by 2 workers
        "data": {"target": "faults:build_data", "params": {"num_samples": 2002}},
        "train": {
            "epochs": epochs,
            "global_batch_size": 32,
            "lr": 0.01,
            "checkpoint_every_steps": 10,
            "keep_checkpoints": 3,
        },
        "scaling": {"num_workers": 2},
        "dataloader": {"num_workers": 0},
        "fault_tolerance": {"max_failures": 0},
    }


def cli_env(ray_tmp: str) -> dict[str, str]:
    """The environment of a ``raytrain train`` subprocess: no cluster address, so it starts
    its own embedded Ray, under ``ray_tmp`` (its processes name it: see testing/processes)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # The workloads importable by name, as PYTHONPATH makes a user's package.
    paths = [str(EXAMPLES), str(TEST_WORKLOADS), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env["RAY_TMPDIR"] = ray_tmp
    return env


def newest_step(run_dir: Path) -> int:
    """The optimizer step of the run's newest complete checkpoint; 0 when it has none."""
    found = ckpt.checkpoints_newest_first(run_dir / "checkpoints")
    return ckpt.read_meta(found[0])["step"] if found else 0


def wait_for_checkpoint_after(run_dir: Path, step: int, proc: subprocess.Popen) -> int:
    """Wait until the running ``proc`` has written a checkpoint past ``step``; its step."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        newest = newest_step(run_dir)
        if newest > step:
            return newest
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint after step {step} was written")


def assert_same_as(run_dir: Path, reference: rt.TrainResult) -> None:
    """Every epoch's metrics (timings aside) and the final weights are bit-for-bit equal."""
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [row["epoch"] for row in reference.metrics]
    for row, expected in zip(rows, reference.metrics, strict=True):
        for column, value in expected.items():
            if column not in TIMING_COLUMNS:
                assert row[column] == value, (row["epoch"], column)
    ours = rt.load_model(run_dir, trust_code=True)
    theirs = rt.load_model(reference.run_dir, trust_code=True)
    for key, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], tensor), key


def assert_close_to(
    run_dir: Path, expected: list[dict], weights: dict[str, torch.Tensor], steps: list[int]
) -> None:
    """The run's epochs at ``steps`` and its final weights within float rounding of an
    uninterrupted run's (``expected`` rows, ``weights``): a change of world size sums each
    step's gradients in another order."""
    import pytest

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == steps
    for row, want in zip(rows, expected, strict=True):
        for column in ("train_loss", "val_loss", "lr"):
            assert row[column] == pytest.approx(want[column], rel=1e-5, abs=1e-9), column
    ours = rt.load_model(run_dir, trust_code=True).state_dict()
    for key, tensor in weights.items():
        torch.testing.assert_close(ours[key], tensor, rtol=1e-5, atol=1e-7)
