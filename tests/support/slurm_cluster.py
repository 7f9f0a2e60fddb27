"""A private SLURM cluster on this machine, for tests: 1 or 2 nodes, torn down by PID.

Each node is its own PID, mount, UTS and network namespace (``unshare``) with a small
PID 1 that reaps orphans: Ray's daemons would otherwise linger as zombies, and
``ray symmetric-run`` ends with ``ray stop``, which stops every Ray process it can see, so
each node must see only its own. Node 1 runs munged, slurmctld and slurmd; node 2 runs
slurmd. A veth pair joins the two network namespaces on a private /24 used only inside
them. Client commands (``sbatch``) run through ``nsenter``.

The nodes are as separate as real ones, so that a plan made with one node's CPUs or a file
written to one node's disk shows up as the bug it is:
- CPUs: a node's whole process tree (its PID 1, hence slurmd and every job step) runs under
  ``taskset`` on that node's own cores.
- Disks: ``/tmp`` and ``/scratch`` are node-local, a per-node host directory bind-mounted in
  the node's private mount namespace. Everything else is common, as a shared filesystem is;
  the cluster's own directory (munge socket, state, logs, the jobs' run directories and
  ``.out`` files) is therefore under /var/tmp, not /tmp.
- Object storage: ``start_s3`` runs an S3-compatible server (moto) on node 1's address.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from paths import ROOT

from raytrain_app.testing.isolation import isolated_env
from raytrain_app.testing.s3_server import S3Server, start_s3_server

SUBNET = "10.77.0"  # only inside the test's own network namespaces
SLURM_PACKAGES = ("slurmctld", "slurmd", "sbatch", "munged", "unshare", "nsenter", "ip", "taskset")
# Paths every node has to itself; /var/tmp, which holds the cluster's directory, is shared.
NODE_LOCAL_DIRS = ("/tmp", "/scratch")
SHARED_PARENT = "/var/tmp"
# Inside node 1's network namespace only SLURM's and the jobs' Ray ports are taken.
S3_PORT = 9000

# PID 1 of a node: starts the node's services, then reaps every orphan until killed.
_REAPER = textwrap.dedent("""
    import os, subprocess, sys, time
    subprocess.Popen(["bash", sys.argv[1]])
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.2)
""")


def missing_requirements() -> str | None:
    """Why this machine cannot host the test cluster, or None."""
    if os.geteuid() != 0:
        return "creating network namespaces for the SLURM nodes needs root"
    missing = [
        tool
        for tool in SLURM_PACKAGES
        if not any((Path(d) / tool).exists() for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"))
    ]
    if missing:
        return (
            f"SLURM test cluster needs {', '.join(missing)} (apt-get install slurmctld "
            "slurmd slurm-client munge iproute2)"
        )
    return None


@dataclass
class Node:
    name: str
    address: str
    cores: tuple[int, ...]  # the host CPUs its processes may run on
    local_root: Path  # host directory behind its NODE_LOCAL_DIRS
    process: subprocess.Popen | None = None

    def local_dir(self, path: str) -> Path:
        """The host directory behind one of NODE_LOCAL_DIRS on this node."""
        return self.local_root / path.strip("/")

    @property
    def init_pid(self) -> int:
        """Host PID of the node's PID 1 (the child ``unshare --fork`` made)."""
        assert self.process is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            if pids:
                return int(pids[0])
            time.sleep(0.05)
        raise RuntimeError(f"node {self.name} has no init process")


@dataclass
class SlurmCluster:
    """The running cluster; ``run`` executes a command on node 1 as a cluster client."""

    root: Path  # on the filesystem every node shares
    nodes: list[Node]
    cpus: int
    env: dict[str, str] = field(default_factory=dict)
    s3_servers: list[S3Server] = field(default_factory=list)

    @property
    def shared(self) -> Path:
        """The cluster's directory on the shared filesystem (same path on every node)."""
        return self.root

    def node_path(self, node: int, path: str | Path) -> Path:
        """Where on this machine ``path`` is as node ``node`` (0-based) sees it: its own host
        directory for node-local paths (``/tmp/x``), the path itself for shared ones."""
        path = Path(path)
        for local in NODE_LOCAL_DIRS:
            if path.is_relative_to(local):
                return self.nodes[node].local_dir(local) / path.relative_to(local)
        return path

    def read_object(self, server: S3Server, uri: str) -> str | None:
        """The text of an object (None when absent), read from node 1 as a job would."""
        code = (
            "import sys\nfrom pyarrow import fs\n"
            "filesystem, path = fs.FileSystem.from_uri(sys.argv[1])\n"
            "if filesystem.get_file_info(path).type != fs.FileType.File: sys.exit(3)\n"
            "sys.stdout.write(filesystem.open_input_stream(path).read().decode())\n"
        )
        done = self.run(["python", "-c", code, uri], env=server.env(), timeout=60)
        if done.returncode == 3:
            return None
        assert done.returncode == 0, done.stderr
        return done.stdout

    def list_objects(self, server: S3Server, uri: str) -> list[str]:
        """Every object below ``uri``, as paths relative to it."""
        code = (
            "import sys\nfrom pyarrow import fs\n"
            "filesystem, path = fs.FileSystem.from_uri(sys.argv[1])\n"
            "selector = fs.FileSelector(path, recursive=True, allow_not_found=True)\n"
            "for info in filesystem.get_file_info(selector):\n"
            "    if info.type == fs.FileType.File: print(info.path[len(path) + 1:])\n"
        )
        done = self.run(["python", "-c", code, uri], env=server.env(), timeout=60, check=True)
        return done.stdout.split()

    def start_s3(self, bucket: str = "runs", port: int = S3_PORT) -> S3Server:
        """An S3 server in node 1's network namespace on its address, which jobs on every
        node reach at ``server.endpoint_url`` (``server.env()``); so does ``run``. Stopped
        with the cluster."""
        node = self.nodes[0]
        server = start_s3_server(
            host=node.address,
            port=port,
            bucket=bucket,
            enter=("nsenter", "-t", str(node.init_pid), "--net"),
            log_path=self.root / "log" / f"s3-{port}.log",
        )
        self.s3_servers.append(server)
        return server

    def run(
        self,
        command: list[str],
        timeout: float = 300,
        check: bool = False,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``command`` on node 1 with the cluster's environment plus ``env``; ``sbatch``
        and ``srun`` pass that environment on to the job."""
        on_node1 = [
            # On node 1's cores too, as a process started there would be.
            "taskset",
            "--cpu-list",
            ",".join(map(str, self.nodes[0].cores)),
            "nsenter",
            "-t",
            str(self.nodes[0].init_pid),
            "--pid",
            "--mount",
            "--net",
            "--uts",
            f"--wd={cwd or self.root}",
        ]
        return subprocess.run(
            [*on_node1, *command],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def sbatch_wait(
        self, args: list[str], timeout: float = 400, env: dict[str, str] | None = None
    ) -> tuple[str, int]:
        """Submit a job (with ``env`` added to its environment) and wait for it to end;
        returns (job id, its exit code: 128 + the signal's number when a signal ended it, as
        a shell reports it).

        Polls twice a second: ``sbatch --wait`` backs off to 32 s between its own polls.
        """
        submitted = self.run(["sbatch", "--parsable", *args], check=True, env=env)
        job_id = submitted.stdout.strip().split(";")[0]
        self.wait_for_jobs([job_id], timeout)
        code, signal_number = (int(x) for x in self.job_field(job_id, "ExitCode").split(":"))
        return job_id, code or (128 + signal_number if signal_number else 0)

    def wait_for_jobs(self, job_ids: list[str], timeout: float = 300) -> None:
        """Wait until every job has ended (completed, failed, cancelled, ...)."""
        deadline = time.monotonic() + timeout
        while states := {i: s for i in job_ids if (s := self.job_state(i)) not in _ENDED}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"SLURM jobs still {states} after {timeout:.0f} s")
            time.sleep(0.5)

    def job_field(self, job_id: str, name: str) -> str:
        """One ``Name=value`` field of ``scontrol show job`` ("" when absent)."""
        out = self.run(["scontrol", "show", "job", job_id]).stdout
        for token in out.split():
            if token.startswith(f"{name}="):
                return token.split("=", 1)[1]
        return ""

    def job_state(self, job_id: str) -> str:
        return self.job_field(job_id, "JobState") or "UNKNOWN"

    def stop(self) -> None:
        """Stop the S3 servers and every node, then delete the cluster's directory."""
        for server in self.s3_servers:  # only in node 1's network namespace, not its PIDs
            server.stop()
        for node in reversed(self.nodes):
            if node.process and node.process.poll() is None:
                # Killing a PID namespace's init kills everything inside it.
                os.kill(node.init_pid, signal.SIGKILL)
                node.process.wait(timeout=30)
        subprocess.run(["ip", "link", "del", "rt-veth0"], capture_output=True)
        # Outside /tmp nothing cleans it up; the nodes' /tmp (Ray's temp dirs) is inside it.
        shutil.rmtree(self.root, ignore_errors=True)


# Final job states: any other (PENDING, RUNNING, COMPLETING, REQUEUED, ...) may change.
_ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
)


def _slurm_conf(root: Path, nodes: list[Node], cpus: int, ports: dict[str, int]) -> str:
    lines = [
        "ClusterName=rtest",
        f"SlurmctldHost={nodes[0].name}({nodes[0].address})",
        f"SlurmctldPort={ports['ctld']}",
        f"SlurmdPort={ports['slurmd']}",
        f"SrunPortRange={ports['srun']}-{ports['srun'] + 200}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also holds a requeued job back (default 120 s): keep tests short
        f"AuthInfo=socket={root}/munge/munge.socket,cred_expire=10",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        # A requeued job becomes eligible about 10 s after its requeue, and nothing but
        # the backfill pass (every 30 s by default) looks at it then: poll every second.
        "SchedulerParameters=bf_interval=1",
    ]
    for node in nodes:
        lines.append(
            f"NodeName={node.name} NodeAddr={node.address} CPUs={cpus} "
            "RealMemory=4000 State=UNKNOWN"
        )
    lines.append(
        f"PartitionName=debug Nodes={','.join(n.name for n in nodes)} Default=YES "
        "MaxTime=INFINITE State=UP"
    )
    return "\n".join(lines) + "\n"


def _kept_paths() -> list[Path]:
    """The repository and this interpreter's environment, where a node-local path holds
    them on this machine (a clone under /tmp); outermost only."""
    candidates = sorted({ROOT, Path(sys.prefix)}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in candidates:
        local = any(path.is_relative_to(d) for d in NODE_LOCAL_DIRS)
        if local and not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


def _node_script(root: Path, node: Node, first: bool, alone: bool) -> Path:
    """The services one node runs, started by its PID 1."""
    munge = (
        (
            f"munged --force --socket={root}/munge/munge.socket "
            f"--pid-file={root}/munge/munged.pid --log-file={root}/log/munged.log "
            f"--seed-file={root}/munge/munge.seed\n"
        )
        if first
        else ""
    )
    ctld = "slurmctld -D -i &\nsleep 1\n" if first else ""
    # A lone node links to nobody: a veth pair inside its own namespace gives it an address.
    own_link = (
        (
            f"ip link add rt-a type veth peer name rt-b && ip addr add {node.address}/24 "
            "dev rt-a && ip link set rt-a up && ip link set rt-b up"
        )
        if alone
        else ""
    )
    # What every node must see although it lives under a node-local path on this machine (a
    # checkout and its venv under /tmp): bound into the node's own directory first, so the
    # recursive bind below carries it along.
    mounts = []
    for kept in _kept_paths():
        local = next(path for path in NODE_LOCAL_DIRS if kept.is_relative_to(path))
        inside = node.local_dir(local) / kept.relative_to(local)
        inside.mkdir(parents=True, exist_ok=True)
        mounts.append(f"mount --bind {kept} {inside}")
    mounts += [f"mount --rbind {node.local_dir(path)} {path}" for path in NODE_LOCAL_DIRS]
    local_mounts = " && ".join(mounts) + " || exit 1"  # no node rather than a node on /tmp
    script = root / f"start-{node.name}.sh"
    script.write_text(
        textwrap.dedent(f"""\
        set -u
        hostname {node.name}
        ip link set lo up
        {own_link}
        # SLURM binds with AI_ADDRCONFIG, which finds nothing until a non-loopback
        # address exists: wait for this node's.
        until ip -br addr | grep -q ' {node.address}/'; do sleep 0.1; done
        # Hostnames need not resolve on real clusters either, but slurmd looks itself up.
        mount --bind {root}/hosts /etc/hosts
        # Node-local disks (the namespace's mounts are private: nothing reaches the host).
        {local_mounts}
        export SLURM_CONF={root}/slurm.conf
        {munge}{ctld}
        exec slurmd -D -N {node.name}
        """)
    )
    return script


def _wait_for_veth_peer(node: Node) -> None:
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{node.init_pid}/ns/net").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {node.name} did not start")
        time.sleep(0.05)


def _start_node(root: Path, node: Node, script: Path, env: dict) -> None:
    reaper = root / "reaper.py"
    reaper.write_text(_REAPER)
    # The child keeps its own copy of the log descriptor; ours can close at once.
    with (root / "log" / f"{node.name}.out").open("w") as log:
        node.process = subprocess.Popen(
            [
                # Ahead of this machine's other work (under `pytest -n 2`, the distributed
                # tier's training beside the cluster tier): a real node's core is its own.
                # At the same priority, a 1-core node's raylet once took over Ray's 30 s
                # to register with the head.
                "nice",
                "-n",
                "-10",
                # Every process of the node inherits its PID 1's affinity mask.
                "taskset",
                "--cpu-list",
                ",".join(map(str, node.cores)),
                "unshare",
                "--pid",
                "--mount",
                "--propagation",
                "private",
                "--uts",
                "--net",
                "--fork",
                "--mount-proc",
                sys.executable,
                str(reaper),
                str(script),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    _wait_for_veth_peer(node)


def _link(nodes: list[Node]) -> None:
    """A veth pair between the two nodes' network namespaces."""
    a, b = nodes
    subprocess.run(
        [
            "ip",
            "link",
            "add",
            "rt-veth0",
            "netns",
            str(a.init_pid),
            "type",
            "veth",
            "peer",
            "name",
            "rt-veth1",
            "netns",
            str(b.init_pid),
        ],
        check=True,
    )
    for node, dev in ((a, "rt-veth0"), (b, "rt-veth1")):
        enter = ["nsenter", "-t", str(node.init_pid), "--net"]
        subprocess.run([*enter, "ip", "addr", "add", f"{node.address}/24", "dev", dev], check=True)
        subprocess.run([*enter, "ip", "link", "set", dev, "up"], check=True)


def start_cluster(
    num_nodes: int = 1,
    cpus: int = 2,
    venv_bin: Path | None = None,
    ports: dict[str, int] | None = None,
) -> SlurmCluster:
    """Start munge + slurmctld + ``num_nodes`` slurmd; returns once every node is idle.

    Node i (0-based) runs on ``cpus`` host cores from core ``i * cpus`` on, wrapping around
    the cores this process may use: 2 nodes of 1 CPU on 2 cores get one core each.
    """
    root = Path(tempfile.mkdtemp(prefix="rt-slurm-", dir=SHARED_PARENT))
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir()
    os.chmod(root / "munge", 0o755)  # munged wants its socket reachable by every user
    nodes = [
        Node(f"node{i + 1}", f"{SUBNET}.{i + 1}", _cores(i, cpus), root / "nodes" / f"node{i + 1}")
        for i in range(num_nodes)
    ]
    for node in nodes:
        for path in NODE_LOCAL_DIRS:
            node.local_dir(path).mkdir(parents=True)
            os.chmod(node.local_dir(path), 0o1777)  # as /tmp is
    for path in NODE_LOCAL_DIRS:
        Path(path).mkdir(exist_ok=True)  # the mount point; it stays empty on the host
    # Inside fresh network namespaces every port is free; fixed numbers are fine.
    ports = ports or {"ctld": 16817, "slurmd": 16818, "srun": 16900}
    (root / "slurm.conf").write_text(_slurm_conf(root, nodes, cpus, ports))
    hosts = ["127.0.0.1 localhost", *(f"{n.address} {n.name}" for n in nodes)]
    (root / "hosts").write_text("\n".join(hosts) + "\n")
    for node in nodes:
        (root / "spool" / node.name).mkdir()
    bin_dir = str(venv_bin or Path(sys.executable).parent)
    env = isolated_env(
        root / "home",
        # TMPDIR would name a directory of this machine's /tmp, which nodes do not see.
        without=("RAY_", "SLURM_", "PYTHONPATH", "TMPDIR"),
        SLURM_CONF=str(root / "slurm.conf"),
        PATH=f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin",
    )
    cluster = SlurmCluster(root=root, nodes=nodes, cpus=cpus, env=env)
    try:
        for i, node in enumerate(nodes):
            _start_node(root, node, _node_script(root, node, i == 0, num_nodes == 1), env)
        if num_nodes == 2:
            _link(nodes)
        _wait_idle(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _cores(index: int, cpus: int) -> tuple[int, ...]:
    available = sorted(os.sched_getaffinity(0))
    return tuple(sorted({available[(index * cpus + k) % len(available)] for k in range(cpus)}))


def _wait_idle(cluster: SlurmCluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cluster.run(["sinfo", "-h", "-o", "%t %D"], timeout=20).stdout.split()
        if out and out[0] == "idle" and int(out[1]) == len(cluster.nodes):
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-2000:] for p in (cluster.root / "log").glob("*"))
    raise RuntimeError(f"SLURM nodes never became idle:\n{logs}")
