"""`raytrain train --local`: Ray Train's local mode, the run in this process without Ray.

A user debugging a step stops at its ``breakpoint()`` in the terminal; the run's
checkpoints are a Ray run's, so the same run resumes on Ray; Ctrl-C checkpoints and stops
as on Ray; ``--nproc 2`` resumes in two processes under torchrun. Each ends within float
rounding of one uninterrupted run (one worker sums its batch's gradients in another order
than two).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from fault_runs import (
    assert_close_to,
    cli_env,
    fault_config,
    newest_step,
    wait_for_checkpoint_after,
)
from loop_harness import LocalSession, run_loop, worker_task

import raytrain_app as rt
from raytrain_app.config import config_from_dict

pytestmark = pytest.mark.distributed

EPOCHS = 2  # 100 optimizer steps, a checkpoint every 10
KILL_AT_CALL = 75  # one process, one micro-batch a step: step 75, after checkpoint 70


def _config(output_dir: Path, name: str, **model_params) -> dict:
    """The fault workload without dropout: its masks differ between 1 and 2 processes."""
    return fault_config(output_dir, name, epochs=EPOCHS, dropout=0.0, **model_params)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The same training on one worker in this process, never interrupted."""
    out = tmp_path_factory.mktemp("local-ref")
    cfg = config_from_dict(_config(out, "straight") | {"scaling": {"num_workers": 1}})
    result, weights = run_loop(worker_task(cfg, out / "straight"), LocalSession(out / "ckpt"))
    return result["history"], weights


def _local_command(config: dict, tmp_path: Path, *flags: str) -> tuple[list[str], dict]:
    """``raytrain train --local [flags] --config <config written to a file>``, its env
    (a Ray temp dir never made: local mode starts no Ray)."""
    path = tmp_path / f"{config['experiment']['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "raytrain_app.cli", "train", "--local", "--no-progress"]
    return [*command, *flags, "--config", str(path)], cli_env(str(tmp_path / "no-ray"))


def _local_train(config: dict, tmp_path: Path, *flags: str, stdin: str = "") -> tuple[int, str]:
    command, env = _local_command(config, tmp_path, *flags)
    done = subprocess.run(
        command, env=env, input=stdin, capture_output=True, text=True, timeout=300
    )
    return done.returncode, done.stdout + done.stderr


def _assert_ends_as(run_dir: Path, uninterrupted: tuple[list[dict], dict]) -> None:
    assert_close_to(run_dir, *uninterrupted, steps=[50, 100])


def test_a_local_run_stops_at_a_breakpoint_and_after_a_crash_resumes_on_ray(
    ray_cluster, tmp_path, uninterrupted
):
    run_dir = tmp_path / "runs" / "debugged"
    cfg = _config(
        tmp_path / "runs",
        "debugged",
        breakpoint_at_call=3,
        kill_rank=0,
        kill_at_call=KILL_AT_CALL,
        marker=str(tmp_path / "crashed"),
        # the kill waits until checkpoint 70, saved in the background, is complete
        checkpoints_dir=str(run_dir / "checkpoints"),
        await_step=70,
        ray_bookkeeping=False,
    )
    cfg["model"]["target"] = "paused_faults:build_model"
    # At the breakpoint the user prints something and continues; later the process dies
    # without any clean-up (SIGKILL), as a debugging session often ends.
    code, output = _local_train(cfg, tmp_path, stdin="p 'seen in pdb'\nc\n")
    assert code == -signal.SIGKILL, output
    assert "(Pdb)" in output and "'seen in pdb'" in output, output
    assert "starting run locally (Ray Train's local mode)" in output
    assert "Started a local Ray instance" not in output  # no Ray at all
    assert newest_step(run_dir) == 70
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["scaling"]["num_workers"] == 1

    # The same config on Ray (2 workers): it resumes from the local run's checkpoint.
    result = rt.train(cfg, progress=False)
    segments = [(s["step"], s["world_size"]) for s in result.summary["world_size_segments"]]
    assert segments == [(0, 1), (70, 2)], segments
    _assert_ends_as(run_dir, uninterrupted)


def test_ctrl_c_stops_a_local_run_at_a_checkpoint_and_two_processes_resume_it(
    tmp_path, uninterrupted
):
    """Ctrl-C checkpoints at the next step and exits 130, as on Ray; ``--nproc 2`` then
    resumes that run in two processes under torchrun and ends as the uninterrupted run."""
    # 20 ms per micro-batch (the numbers are the same): time to stop it mid-run.
    cfg = _config(tmp_path / "runs", "pair", sleep_s=0.02)
    command, env = _local_command(cfg, tmp_path)
    run_dir = tmp_path / "runs" / "pair"
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        wait_for_checkpoint_after(run_dir, 0, proc)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "stopped on request (SIGINT)" in output, output
    stopped_at = newest_step(run_dir)
    assert 0 < stopped_at < EPOCHS * 50

    code, output = _local_train(cfg, tmp_path, "--nproc", "2")
    assert code == 0, output
    assert output.count("resumed from") == 1 and output.count("epoch 2/2: step=100") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "completed"
    segments = [(s["step"], s["world_size"]) for s in summary["world_size_segments"]]
    assert segments == [(0, 1), (stopped_at, 2)], segments
    # Retention as on Ray (train.keep_checkpoints: 3): the 3 best, the newest among them.
    kept = sorted(p.name for p in (run_dir / "checkpoints" / "pair").iterdir())
    assert len(kept) == 3 and kept[-1].endswith("step000000100"), kept
    _assert_ends_as(run_dir, uninterrupted)
