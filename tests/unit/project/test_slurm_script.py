"""cluster/slurm/raytrain.sbatch without SLURM: fake ``scontrol``, ``srun`` and ``ray``
record what the script would start, so token handling, the dashboard host, Ray's ports and
the job's private files are checked in a second. The fake ``srun`` runs each node's task
as SLURM would (the script's own PID namespace and reaper included); the fake ``ray``
records its arguments and, on the head, runs the entrypoint (a fake ``raytrain``).
(The real thing runs in tests/cluster/test_slurm.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import ROOT

SCRIPT = ROOT / "cluster" / "slurm" / "raytrain.sbatch"
JOB = "1234"

FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=node1" ;;
esac
"""
# Records its command line and environment, then runs the task on every node at once (all
# here), each with its SLURM_NODEID.
FAKE_SRUN = """#!/usr/bin/env python3
import json, os, subprocess, sys
args = sys.argv[1:]
json.dump({"args": args, "env": dict(os.environ)}, open(os.environ["FAKE_OUT"] + "/srun.json", "w"))
task = args[next(i for i, arg in enumerate(args) if not arg.startswith("-")):]
nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
running = [subprocess.Popen(task, env={**os.environ, "SLURM_NODEID": str(n)}) for n in range(nodes)]
sys.exit(max(node.wait() for node in running))
"""
# `ray symmetric-run` of one node: records its arguments, environment, whether its port
# block's spare port (the claim) is held and the modes of its directories while it runs;
# on the head it then runs the entrypoint as symmetric-run does.
FAKE_RAY = """#!/usr/bin/env python3
import json, os, socket, stat, subprocess, sys
args = sys.argv[1:]
node = os.environ["SLURM_NODEID"]
options = dict(arg[2:].split("=", 1) for arg in args[:args.index("--")] if "=" in arg)

def held(port):
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", port))
        return False
    except OSError:
        return True
    finally:
        probe.close()

def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode) if path and os.path.isdir(path) else None

start = int(options.get("node-manager-port", 0)) - 1
state = os.environ.get("RAYTRAIN_JOB_STATE")
seen = {
    "args": args,
    "env": dict(os.environ),
    "claim_held": held(start + 15) if start > 0 else None,
    "temp_dir_mode": mode(options.get("temp-dir")),
    "state_mode": mode(state),
}
json.dump(seen, open(os.environ["FAKE_OUT"] + f"/ray-{node}.json", "w"))
if node == "0":
    sys.exit(subprocess.run(args[args.index("--") + 1:]).returncode)
"""


# The config check before Ray starts: `raytrain plan --json` refuses when FAKE_PLAN_FAILS is
# set, and plans workers the allocation cannot host when FAKE_PLAN_UNFIT is. The training
# itself exits with FAKE_TRAIN_EXIT (default 0).
FAKE_RAYTRAIN = """#!/usr/bin/env bash
if [[ $1 != plan ]]; then exit "${FAKE_TRAIN_EXIT:-0}"; fi
if [[ -n ${FAKE_PLAN_FAILS:-} ]]; then echo "error: unknown config key 'train.lrr'" >&2; exit 2; fi
if [[ -n ${FAKE_PLAN_UNFIT:-} ]]; then
  echo "WARNING scaling.num_workers=8 needs more than the 2 workers" >&2
  echo '{"world_size": 8, "fits": false, "worker_range": null}'
else
  echo '{"world_size": 2, "fits": true, "worker_range": null}'
fi
"""


def run_script(
    tmp_path: Path, code: int = 0, **extra_env: str
) -> tuple[str, list[str], dict[str, str]]:
    """Run the script as sbatch would; return its output, srun's arguments and environment.
    ``code``: the exit status the job must end with."""
    fakes = tmp_path / "bin"
    fakes.mkdir(exist_ok=True)
    for name, text in (
        ("scontrol", FAKE_SCONTROL),
        ("srun", FAKE_SRUN),
        ("ray", FAKE_RAY),
        ("raytrain", FAKE_RAYTRAIN),
    ):
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    env = {
        "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": JOB,
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_ON_NODE": "2",
        "RAY_TMP_ROOT": str(tmp_path),
        "FAKE_OUT": str(tmp_path),
        **extra_env,
    }
    result = _sbatch(env)
    assert result.returncode == code, result.stdout + result.stderr
    srun = json.loads((tmp_path / "srun.json").read_text())
    return result.stdout + result.stderr, srun["args"], srun["env"]


def ray_seen(tmp_path: Path, node: int = 0) -> dict:
    """What the fake ``ray`` of ``node`` recorded."""
    return json.loads((tmp_path / f"ray-{node}.json").read_text())


def ray_ports(seen: dict) -> dict[str, int]:
    """Every port option a node's Ray got: the GCS port as ``gcs``, then ray start's own."""
    ports = {"gcs": int(seen["args"][seen["args"].index("--address") + 1].rsplit(":", 1)[1])}
    for arg in seen["args"]:
        if match := re.fullmatch(r"--([a-z-]+port)=(\d+)", arg):
            ports[match[1]] = int(match[2])
    return ports


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


# ---------------------------------------------------------------------------- Ray's ports
# Issue 29: the blocks repeated every 300 job ids, so two jobs on one node could get the same
# one, and most lay in Linux's ephemeral range, where any outgoing connection may take a port.

EPHEMERAL_START = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
PORT_NAMES = {
    "gcs",
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


def assert_one_block(ports: dict[str, int], head: bool = True) -> int:
    """Every Ray port is set (none left at Ray's fixed defaults: GCS 6379, dashboard 8265,
    Ray Client 10001), none twice, all in one block of 128 from 20000 on and below the
    ephemeral range; returns the block's first port. Another node than the head has the
    head's GCS port, not one of its own."""
    if not head:
        ports = {name: port for name, port in ports.items() if name != "gcs"}
    assert set(ports) == (PORT_NAMES if head else PORT_NAMES - {"gcs"})
    start = min(ports.values())
    singles = [port for name, port in ports.items() if "worker-port" not in name]
    workers = range(ports["min-worker-port"], ports["max-worker-port"] + 1)
    assert len(set(singles)) == len(singles) and not set(singles) & set(workers)
    assert all(start <= port < start + 128 for port in [*singles, *workers])
    assert start >= 20000 and start + 127 < min(EPHEMERAL_START, 32768)
    return start


@contextlib.contextmanager
def listening(port: int, host: str) -> Iterator[None]:
    """A socket listening on ``host:port`` meanwhile: another job's claim, or any program."""
    with socket.socket() as sock:
        sock.bind((host, port))
        sock.listen(1)
        yield


@pytest.mark.parametrize("job", ["1234", "1450", "99999"])
def test_every_ray_port_comes_from_one_block_below_the_ephemeral_range(tmp_path, job):
    run_script(tmp_path, SLURM_JOB_ID=job)
    assert_one_block(ray_ports(ray_seen(tmp_path)))


def test_the_job_holds_its_block_while_ray_runs(tmp_path):
    run_script(tmp_path)
    assert ray_seen(tmp_path)["claim_held"] is True


def test_a_block_another_job_holds_is_never_used(tmp_path):
    """The same job id again (job ids that map to one block alike) while the first job still
    holds its claim: a block of its own."""
    run_script(tmp_path)
    first = assert_one_block(ray_ports(ray_seen(tmp_path)))
    with listening(first + 15, "127.0.0.1"):
        run_script(tmp_path)
    second = assert_one_block(ray_ports(ray_seen(tmp_path)))
    assert abs(second - first) >= 128


def test_a_port_in_use_on_the_node_moves_the_job_to_another_block(tmp_path):
    run_script(tmp_path)
    first = assert_one_block(ray_ports(ray_seen(tmp_path)))
    with listening(first + 1, "0.0.0.0"):  # say, another program on the node manager's port
        run_script(tmp_path)
    ports = ray_ports(ray_seen(tmp_path))
    assert_one_block(ports)
    assert first + 1 not in range(min(ports.values()), min(ports.values()) + 128)


def test_every_node_claims_a_block_and_a_private_temp_dir_of_its_own(tmp_path):
    run_script(tmp_path, SLURM_JOB_NUM_NODES="2")
    head, other = ray_seen(tmp_path, 0), ray_seen(tmp_path, 1)
    assert_one_block(ray_ports(other), head=False)
    assert other["claim_held"] is True  # held by that node's own task
    head_tmp = next(a for a in head["args"] if a.startswith("--temp-dir="))
    other_tmp = next(a for a in other["args"] if a.startswith("--temp-dir="))
    assert head_tmp != other_tmp and other["temp_dir_mode"] == 0o700


# ------------------------------------------------------------------- the job's own files
# Issue 29: the status and PID files lived at /tmp/rt-<jobid>.*, which another user of the
# node could make first (a failed job reported as a success, or requeued forever).


@pytest.mark.parametrize("where", ["SLURM_TMPDIR", "TMPDIR", None])
def test_the_jobs_state_lives_in_a_private_dir_made_for_it(tmp_path, where):
    job_tmp = tmp_path / "job-tmp"
    job_tmp.mkdir()
    extra = {where: str(job_tmp)} if where else {}
    if where == "SLURM_TMPDIR":
        extra["TMPDIR"] = str(tmp_path / "not-this-one")
    run_script(tmp_path, code=3, FAKE_TRAIN_EXIT="3", **extra)  # the status read back
    seen = ray_seen(tmp_path)
    state = Path(seen["env"]["RAYTRAIN_JOB_STATE"])
    assert state.parent == (job_tmp if where else Path("/tmp"))
    assert re.fullmatch(rf"raytrain-{JOB}\.\w{{8}}", state.name)  # a name no one can guess
    assert seen["state_mode"] == 0o700
    assert not state.exists()  # gone with the job
    assert not [p.name for p in tmp_path.glob(f"rt-{JOB}.*") if not p.is_dir()]
    assert not [p for p in Path("/tmp").glob(f"rt-{JOB}.*") if not p.is_dir()]


def test_rays_temp_dir_is_private_and_new_for_every_job(tmp_path):
    run_script(tmp_path)
    first = ray_seen(tmp_path)
    run_script(tmp_path)
    second = ray_seen(tmp_path)
    temp_dirs = [
        Path(next(a for a in seen["args"] if a.startswith("--temp-dir=")).split("=", 1)[1])
        for seen in (first, second)
    ]
    assert temp_dirs[0] != temp_dirs[1]
    assert all(d.parent == tmp_path and d.name.startswith(f"rt-{JOB}.") for d in temp_dirs)
    assert first["temp_dir_mode"] == second["temp_dir_mode"] == 0o700


def test_a_failed_training_fails_the_job(tmp_path):
    output, _, _ = run_script(tmp_path, code=1, FAKE_TRAIN_EXIT="1")
    assert "requeued" not in output
