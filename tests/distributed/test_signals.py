"""Ctrl-C and SIGKILL to a 2-worker `raytrain train`: it checkpoints and exits 130 (or dies
at once, its embedded Ray with it), and the same command resumes to the weights of an
uninterrupted run, bit for bit. While it runs, a second `raytrain train` into the same run
directory is refused.

The CLI runs as a subprocess in its own session with its own embedded Ray, as a user's
terminal would run it; Ctrl-C is SIGINT to the whole foreground process group (the driver
and every Ray process it started), which is what a terminal sends. SIGUSR1 under SLURM:
tests/cluster/test_slurm.py. SIGTERM to the driver alone takes SIGUSR1's path, with its
own exit code (tests/unit/driver/test_stop_signals.py): a stage of its own here cost half a
minute of CI for no path the two do not already run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fault_runs import assert_same_as, cli_env, fault_config, newest_step, wait_for_checkpoint_after

from raytrain_app.testing.processes import wait_until_gone

pytestmark = pytest.mark.distributed

EPOCHS = 4  # 200 optimizer steps, a checkpoint every 10: the session's fault_reference


def _interrupt(command: list[str], env: dict, run_dir: Path, send, meanwhile=None):
    """Start ``command`` in a session of its own, call ``send(proc)`` once it has written a
    checkpoint newer than the run directory's newest, and wait for it to exit.

    ``meanwhile(proc)``, if given, runs as soon as the run holds its directory's lease
    (before its Ray starts), while it is still starting.

    Returns its exit code, its output, the newest checkpoint's step before it stopped and
    what ``meanwhile`` returned.
    """
    before = newest_step(run_dir)
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a terminal's foreground job
    ) as proc:
        during = None
        if meanwhile is not None:
            deadline = time.monotonic() + 60
            while not (run_dir / ".lease.json").is_file():
                assert proc.poll() is None and time.monotonic() < deadline, "no lease taken"
                time.sleep(0.05)
            during = meanwhile(proc)
        seen = wait_for_checkpoint_after(run_dir, before, proc)
        send(proc)
        output, _ = proc.communicate(timeout=180)
    return proc.returncode, output, seen, during


def _second_terminal(command: list[str], env: dict):
    """The same command started again while the first one runs, as from a second terminal."""

    def start(first: subprocess.Popen) -> tuple[subprocess.CompletedProcess, int]:
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert first.poll() is None, "the first run ended before the second was refused"
        return second, first.pid

    return start


def test_ctrl_c_and_sigkill_stop_the_run_and_the_same_command_resumes_exactly(
    fault_reference, tmp_path, ray_tmp
):
    # 50 ms per micro-batch (the numbers are the same), 10 s of training in all: each stop
    # lands mid-run even when a busy machine is slow to deliver it (at 20 ms, once, the run
    # reached its last step before the SIGKILL, and nothing was left to resume).
    cfg = fault_config(tmp_path, "signalled", epochs=EPOCHS, sleep_s=0.05)
    config_file = tmp_path / "signalled.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    # With progress on, as a user runs it; its output is a pipe, as a log file is.
    command = [sys.executable, "-m", "raytrain_app.cli", "train", "--config", str(config_file)]
    run_dir = tmp_path / "signalled"
    env = cli_env(ray_tmp)  # the fixture stops any Ray left naming it, even on failure
    # Ctrl-C: SIGINT to the driver and every Ray process in its process group.
    code, output, seen, (second, first_pid) = _interrupt(
        command,
        env,
        run_dir,
        lambda proc: os.killpg(proc.pid, signal.SIGINT),
        meanwhile=_second_terminal(command, env),
    )
    # One writer per run directory: the second exits 2 naming the first, before its Ray.
    assert second.returncode == 2, second.stdout + second.stderr
    refusal = second.stderr.strip().splitlines()[-1]
    assert refusal.startswith(f"error: run directory '{run_dir}' is being written by ")
    assert f"raytrain train on host {socket.gethostname()} (pid {first_pid}" in refusal
    assert "Traceback" not in second.stderr and "Ray" not in second.stderr
    assert code == 130, output
    assert "stopped on request (SIGINT)" in output, output
    stopped_at = newest_step(run_dir)
    assert seen <= stopped_at < EPOCHS * 50, "no checkpoint at the stop"

    # SIGKILL: no clean-up at all; the embedded Ray dies with its driver.
    code, output, seen, _ = _interrupt(
        command, env, run_dir, lambda proc: proc.send_signal(signal.SIGKILL)
    )
    assert code == -signal.SIGKILL, output
    assert "resumed from" in output and seen > stopped_at, output
    assert newest_step(run_dir) < EPOCHS * 50, "the run ended before its SIGKILL"
    # The processes of the CLI's embedded Ray name its temp dir.
    assert not wait_until_gone(ray_tmp, timeout_s=60), "Ray outlived its SIGKILLed driver"

    final = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = final.stdout + final.stderr
    assert final.returncode == 0, output
    assert "resumed from" in output and "epoch 4/4: step=200" in output
    # A log gets plain lines, never a bar's redraws, and no notice about Ray's token auth.
    assert "\r" not in output and "step/s" not in output
    assert "Token authentication" not in output
    # Worker lines reach a pipe as text: their prefix without Ray's ANSI colour codes.
    assert "(RayTrainWorker pid=" in output and "\x1b[" not in output
    # Its own rows and checkpoints only: none written twice (the refused run wrote none).
    assert not list(run_dir.glob("checkpoints/*/*-r[0-9]*"))
    assert_same_as(run_dir, fault_reference)
