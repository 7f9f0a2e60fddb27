"""raytrain_app.testing without Ray: ports, processes found by marker, HOME isolation."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from raytrain_app.testing.isolation import isolated_env, private_home
from raytrain_app.testing.ports import free_ports
from raytrain_app.testing.processes import pids_naming, stop_processes_naming


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


def test_a_process_is_found_by_its_marker_and_stopped_even_when_it_ignores_sigterm():
    marker = f"rt-marker-{uuid.uuid4().hex}"
    ignores_term = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    ignores_term += "print('ready', flush=True); time.sleep(120)"
    with subprocess.Popen(
        [sys.executable, "-c", ignores_term, marker, "--port=1234"],
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout.readline() == "ready\n"
        assert pids_naming(marker) == [proc.pid]
        # Every marker must be there; "\0" ends an argument, so 123 is not 1234.
        assert pids_naming(marker, "--port=1234\0") == [proc.pid]
        assert pids_naming(marker, "--port=123\0") == []
        assert pids_naming(marker, "rt-other-marker") == []
        stop_processes_naming(marker, "--port=1234\0")
        assert proc.wait(timeout=10) == -9
    assert pids_naming(marker) == []


def test_isolated_env_has_its_own_home_and_no_cluster(tmp_path, monkeypatch):
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "SLURM_JOB_ID"):
        monkeypatch.setenv(name, "inherited")
    env = isolated_env(tmp_path / "home", without=("SLURM_",), RAY_TMPDIR="/tmp/x")
    assert env["HOME"] == str(tmp_path / "home") and (tmp_path / "home").is_dir()
    assert not [k for k in env if k.startswith(("RAY_ADDRESS", "RAY_AUTH_", "SLURM_"))]
    assert env["RAY_TMPDIR"] == "/tmp/x"
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)


def test_private_home_restores_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    before = dict(os.environ)
    with private_home(tmp_path / "home"):
        assert os.environ["HOME"] == str(tmp_path / "home")
        assert "RAY_ADDRESS" not in os.environ
        os.environ["RAY_AUTH_TOKEN"] = "set-inside"
    assert dict(os.environ) == before
