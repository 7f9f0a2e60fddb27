"""cluster/slurm/raytrain.sbatch without SLURM: fake ``scontrol`` and ``srun`` record what
the script would start, so token handling and the dashboard host are checked in a second.
(The real thing runs in tests/cluster/test_slurm.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from paths import ROOT

SCRIPT = ROOT / "cluster" / "slurm" / "raytrain.sbatch"

FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=node1" ;;
esac
"""
# Records its command line and environment, then reports a finished training.
FAKE_SRUN = """#!/usr/bin/env python3
import json, os, sys
out = os.environ["FAKE_OUT"]
json.dump({"args": sys.argv[1:], "env": dict(os.environ)}, open(out + "/srun.json", "w"))
open(f"{os.environ['RAY_TMP_ROOT']}/rt-{os.environ['SLURM_JOB_ID']}.status", "w").write("0")
"""


# The config check before Ray starts: `raytrain plan --json` refuses when FAKE_PLAN_FAILS is
# set, and plans workers the allocation cannot host when FAKE_PLAN_UNFIT is.
FAKE_RAYTRAIN = """#!/usr/bin/env bash
if [[ -n ${FAKE_PLAN_FAILS:-} ]]; then echo "error: unknown config key 'train.lrr'" >&2; exit 2; fi
if [[ -n ${FAKE_PLAN_UNFIT:-} ]]; then
  echo "WARNING scaling.num_workers=8 needs more than the 2 workers" >&2
  echo '{"world_size": 8, "fits": false}'
else
  echo '{"world_size": 2, "fits": true}'
fi
"""


def run_script(tmp_path: Path, **extra_env: str) -> tuple[str, list[str], dict[str, str]]:
    """Run the script as sbatch would; return its output, srun's arguments and environment."""
    fakes = tmp_path / "bin"
    fakes.mkdir(exist_ok=True)
    for name, text in (
        ("scontrol", FAKE_SCONTROL),
        ("srun", FAKE_SRUN),
        ("raytrain", FAKE_RAYTRAIN),
    ):
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    env = {
        "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_ON_NODE": "2",
        "RAY_TMP_ROOT": str(tmp_path),
        "FAKE_OUT": str(tmp_path),
        **extra_env,
    }
    result = _sbatch(env)
    assert result.returncode == 0, result.stdout + result.stderr
    srun = json.loads((tmp_path / "srun.json").read_text())
    return result.stdout + result.stderr, srun["args"], srun["env"]


def _sbatch(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), "--config", "my.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_refused_config_fails_the_job_before_ray_starts(tmp_path):
    with pytest.raises(AssertionError, match="Ray not started"):
        run_script(tmp_path, FAKE_PLAN_FAILS="1")
    assert not (tmp_path / "srun.json").exists()  # srun (and so Ray) never ran


def test_workers_the_allocation_cannot_host_fail_the_job_before_ray_starts(tmp_path):
    with pytest.raises(AssertionError, match="cannot host the planned workers.*Ray not started"):
        run_script(tmp_path, FAKE_PLAN_UNFIT="1")
    assert not (tmp_path / "srun.json").exists()


def test_token_auth_is_on_with_a_fresh_token_that_is_never_printed(tmp_path):
    output, args, env = run_script(tmp_path)
    token = env["RAY_AUTH_TOKEN"]
    assert env["RAY_AUTH_MODE"] == "token" and re.fullmatch(r"[0-9a-f]{64}", token)
    assert token not in output
    assert not any(token in arg for arg in args)  # not on a command line (ps shows those)
    _, _, again = run_script(tmp_path)
    assert again["RAY_AUTH_TOKEN"] != token  # one token per job
    text = SCRIPT.read_text()
    assert not re.search(r"^\s*set\s+-[a-z]*x|xtrace", text, flags=re.M)


def test_the_dashboard_binds_to_localhost_unless_the_user_opts_in(tmp_path):
    output, args, _ = run_script(tmp_path)
    assert "--dashboard-host=127.0.0.1" in args
    assert re.search(r"dashboard 127\.0\.0\.1:\d+", output)  # where to point an SSH tunnel
    output, args, _ = run_script(tmp_path, RAYTRAIN_DASHBOARD_HOST="0.0.0.0")
    assert "--dashboard-host=0.0.0.0" in args and "--dashboard-host=127.0.0.1" not in args


def test_every_ray_port_comes_from_the_jobs_own_block(tmp_path):
    """Two jobs on one node never share a port: each of Ray's listening ports is set, none
    left at Ray's fixed defaults (GCS 6379, dashboard 8265, Ray Client 10001), and all lie
    in the job's block of 128."""
    _, args, _ = run_script(tmp_path)
    base = 20000 + (1234 % 300) * 128  # RAY_PORT_BASE + (job id % RAY_PORT_SLOTS) * 128
    ports = {m[1]: int(m[2]) for arg in args if (m := re.fullmatch(r"--([a-z-]+port)=(\d+)", arg))}
    assert set(ports) == {
        "node-manager-port",
        "object-manager-port",
        "dashboard-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
        "ray-client-server-port",
        "min-worker-port",
        "max-worker-port",
    }
    gcs = int(args[args.index("--address") + 1].rsplit(":", 1)[1])
    singles = [gcs] + [port for name, port in ports.items() if "worker-port" not in name]
    assert len(set(singles)) == len(singles)
    workers = range(ports["min-worker-port"], ports["max-worker-port"] + 1)
    assert not any(port in workers for port in singles)
    assert all(base <= port < base + 128 for port in [*singles, *workers])
