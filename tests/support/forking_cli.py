"""Run ``raytrain`` commands fast: import the CLI once, fork a child per command.

A fresh ``python -m raytrain_app.cli`` pays several seconds of torch and Ray imports (~3 s;
minutes of CPU for a table of cases). So one runner process imports the CLI once and forks a
child per command; the child runs ``sys.exit(cli.main())`` with its own stdout, stderr and
exit status, exactly as the ``raytrain`` entry point does: an uncaught exception prints a
traceback and exits 1, a non-integer exit code is printed and exits 1.

What differs between callers is a parameter:

- ``preimport``: the modules the runner imports before any fork, in order (``ray`` and
  ``raytrain_app.cli`` are always imported). A caller whose commands must import what a fresh
  process would (a checkpoint's payload modules above all) names none of those here.
- ``refuse_ray_init``: where given, ``ray.init`` is replaced in the runner by a function that
  raises ``AssertionError`` with this message, so a command that slips through to Ray fails
  with a traceback instead of starting a cluster.
- ``run(..., cwd=, env=)``: where given, the child takes that working directory (also put
  first on ``sys.path``, as ``python -m`` would) and exactly that environment; otherwise it
  keeps the runner's own.
- ``run(..., timeout_s=)``: past it the child is killed and the code is ``"timed out"``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


class ForkingCli:
    """A process that imported the CLI once and runs each command in a forked child.

    ``cwd`` and ``env`` are the runner's own; ``io`` (an existing folder) receives
    ``runner.log`` and each command's stdout and stderr files.
    """

    def __init__(
        self,
        *,
        cwd: Path,
        env: Mapping[str, str],
        io: Path,
        preimport: Sequence[str] = (),
        refuse_ray_init: str | None = None,
    ) -> None:
        self.io = io
        self.count = 0
        options = {"preimport": list(preimport), "refuse_ray_init": refuse_ray_init}
        self.log = (io / "runner.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RUNNER, json.dumps(options)],
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        ready = self.proc.stdout.readline()
        assert ready == "ready\n", (io / "runner.log").read_text()

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        name: str | None = None,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """``raytrain <argv>`` in a forked child; its output goes to ``io/<name>.out|.err``
        (``name`` defaults to a running count). ``returncode`` is the child's exit status, or
        the string ``"timed out"`` where it was killed after ``timeout_s``."""
        self.count += 1
        name = name if name is not None else str(self.count)
        out, err = self.io / f"{name}.out", self.io / f"{name}.err"
        job = {"argv": list(argv), "stdout": str(out), "stderr": str(err), "timeout_s": timeout_s}
        if cwd is not None:
            job["cwd"] = str(cwd)
        if env is not None:
            job["env"] = dict(env)
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, (self.io / "runner.log").read_text()
        code = json.loads(reply)["code"]
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    def close(self) -> None:
        # End of input ends the runner; it has nothing left to check, so one starved of CPU
        # (the compatibility tier runs in the idle class beside the main suite) is killed
        # rather than failing a test that already passed.
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# Runs in the runner process: import once, then fork per command. A child exits as the console
# script would: sys.exit(main()), an uncaught exception printing a traceback (status 1); in
# the job's working directory (first on sys.path) and environment where the job names them.
_RUNNER = r"""
import importlib, json, os, sys, time, traceback

import ray

OPTIONS = json.loads(sys.argv[1])
for module in OPTIONS["preimport"]:
    importlib.import_module(module)
from raytrain_app import cli


def refuse(*args, **kwargs):
    raise AssertionError(OPTIONS["refuse_ray_init"])


if OPTIONS["refuse_ray_init"] is not None:
    ray.init = refuse


def run_case(job):
    if "cwd" in job:
        os.chdir(job["cwd"])
        sys.path[0] = job["cwd"]
    if "env" in job:
        os.environ.clear()
        os.environ.update(job["env"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["raytrain", *job["argv"]]
    try:
        code = cli.main()
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    return code


print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = run_case(job)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + job["timeout_s"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            code = "timed out"
            break
        time.sleep(0.01)
    print(json.dumps({"code": code}), flush=True)
"""
