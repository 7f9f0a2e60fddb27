"""Shared test set-up: keep Ray and raytrain away from the user's home and clusters; one
real Ray and one uninterrupted reference run per session, for the tiers that need them."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
from fault_runs import fault_config
from ray_sessions import session_ray

import raytrain_app as rt
from raytrain_app.testing.isolation import private_home, ray_temp_dir
from raytrain_app.testing.processes import stop_processes_naming
from raytrain_app.tracking.metrics_log import read_metrics

# Under `pytest -n N` (pytest-xdist, the README's command), each of these tiers runs in one
# process: the distributed tier shares its session Ray and reference run, the cluster tier
# runs one private SLURM network at a time, the GPU tier owns the GPUs. The tiers start at
# once, side by side (one tier's start-ups, polls and timeouts leave the CPU to the other's
# training), and the unit tests, one by one, fill whichever process is free first (unit
# tests first made CI's run 1:45 longer: both tiers then started late and ended together).
GROUPED_TIERS = ("distributed", "cluster", "gpu")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, called only under -n
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "load":  # the default of -n; keep any other --dist
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = True  # the largest units first: the tiers

    class TierScheduling(LoadScopeScheduling):
        """Whole tiers as units of work; every other test on its own."""

        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("/", 2)
            if len(parts) == 3 and parts[0] == "tests" and parts[1] in GROUPED_TIERS:
                return f"tests/{parts[1]}"
            return nodeid

    return TierScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_as_in_a_terminal():
    """Ctrl-C handled as in a terminal's foreground job, in this process and every command
    the tests start. A shell starts a background job (`bash .ci/run &`) with SIGINT
    ignored, and children inherit that: the tests that send SIGINT would wait forever."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory):
    """A private HOME (Ray writes ~/.ray/auth_token there) and no inherited cluster variables."""
    with private_home(tmp_path_factory.mktemp("home")):
        yield


@pytest.fixture(autouse=True)
def fresh_raytrain_logger():
    """Each test starts with raytrain's logger as a fresh process has it: no handler, records
    propagating to the root logger. The CLI's main() and the in-process worker loop install
    a stderr handler (bound to the capture of their test's time) and stop propagation; a
    session fixture's run would otherwise leave that to every later test in the process."""
    logger = logging.getLogger("raytrain_app")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    logger.setLevel(logging.NOTSET)
    logger.handlers[:] = []
    logger.propagate = True
    yield
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


@pytest.fixture
def ray_tmp():
    """A fresh Ray temp dir for the embedded Ray of a ``raytrain`` subprocess; afterwards any
    process still naming it is stopped and the directory removed, even on failure."""
    path = ray_temp_dir()
    yield path
    stop_processes_naming(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One real Ray instance per test session: 2 CPUs, its own temp dir and ports."""
    with session_ray(num_cpus=2) as resources:
        yield resources


@pytest.fixture(scope="session")
def fault_reference(request, tmp_path_factory):
    """The uninterrupted 4-epoch ``faults`` run that every interrupted run (a killed worker
    or driver, a stop signal, a preempted SLURM job) is compared with, bit for bit:
    trained once per session. Rank 0 records its DDP communication hooks and its nice value
    in ``hooks.json`` beside the run directory (test_faults reads them).

    Under ``pytest -n N`` it is trained once for the whole run, not once per process: the
    first tier to need it trains it in its session Ray and leaves where it lies in the run's
    shared temp dir; another tier reads it from there (the cluster tier would otherwise start
    a session Ray for this one run, some 60 s of CI beside the distributed tier)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _train_fault_reference(request, tmp_path_factory)
    published = tmp_path_factory.getbasetemp().parent / "fault_reference.json"
    with open(f"{published}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other tier waits while one trains it
        if published.is_file():
            from raytrain_app.driver.training import TrainResult  # imports Ray: only here

            run_dir = Path(json.loads(published.read_text())["run_dir"])
            summary = json.loads((run_dir / "summary.json").read_text())
            return TrainResult(run_dir=run_dir, summary=summary, metrics=read_metrics(run_dir))
        result = _train_fault_reference(request, tmp_path_factory)
        published.write_text(json.dumps({"run_dir": str(result.run_dir)}))
        return result


def _train_fault_reference(request, tmp_path_factory) -> rt.TrainResult:
    request.getfixturevalue("ray_cluster")
    out = tmp_path_factory.mktemp("ref")
    cfg = fault_config(out, "straight", record_comm_hooks=str(out / "hooks.json"))
    return rt.train(cfg, progress=False)
