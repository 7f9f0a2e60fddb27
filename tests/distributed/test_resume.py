"""A run interrupted after epoch k resumes at epoch k+1 and ends where an uninterrupted run ends.

The interrupted run is the real CLI in a subprocess, stopped with Ctrl-C (SIGINT) once it
has checkpointed epoch k; the re-run is the same command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import raytrain_app as rt
from raytrain_app.metrics_log import read_metrics

pytestmark = pytest.mark.distributed

EPOCHS = 5
STOP_AFTER = 2


def _overrides(output_dir: Path, name: str) -> list[str]:
    return [
        f"experiment.output_dir={output_dir}",
        f"experiment.name={name}",
        f"train.epochs={EPOCHS}",
        "data.params.num_turbines=4",
        "data.params.num_hours=2400",
        "scaling.num_workers=2",
        "fault_tolerance.max_failures=0",
    ]


def _cli(overrides: list[str]) -> list[str]:
    args = [sys.executable, "-m", "raytrain_app.cli", "train", "--no-progress"]
    for item in overrides:
        args += ["--set", item]
    return args


def _cli_env(ray_tmp: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_TMPDIR"] = ray_tmp  # the embedded Ray of the subprocess gets its own temp dir
    return env


def _wait_for_checkpointed_epoch(run_dir: Path, epoch: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        checkpoints = list((run_dir / "checkpoints").glob("*/checkpoint_*/meta.json"))
        rows = read_metrics(run_dir)
        if rows and rows[-1]["epoch"] >= epoch and len(checkpoints) >= epoch:
            return
        time.sleep(0.1)
    raise AssertionError(f"epoch {epoch} was never checkpointed")


def test_interrupted_run_resumes_and_ends_like_an_uninterrupted_one(ray_cluster, tmp_path):
    # The same config the CLI builds: the built-in quickstart plus the overrides.
    reference = rt.train(rt.load_config(None, _overrides(tmp_path, "straight")), progress=False)

    ray_tmp = tempfile.mkdtemp(prefix="rt-cli-", dir="/tmp")
    command = _cli(_overrides(tmp_path, "interrupted"))
    run_dir = tmp_path / "interrupted"
    with subprocess.Popen(
        command, env=_cli_env(ray_tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        _wait_for_checkpointed_epoch(run_dir, STOP_AFTER, proc)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output
    stopped_at = read_metrics(run_dir)[-1]["epoch"]
    assert STOP_AFTER <= stopped_at < EPOCHS

    rerun = subprocess.run(
        command, env=_cli_env(ray_tmp), capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resumed from" in rerun.stdout + rerun.stderr

    resumed, straight = read_metrics(run_dir), reference.metrics
    assert [row["epoch"] for row in resumed] == list(range(1, EPOCHS + 1))
    for column in ("train_loss", "val_loss", "val_mae", "step", "lr"):
        assert resumed[-1][column] == pytest.approx(straight[-1][column], rel=1e-6), column
