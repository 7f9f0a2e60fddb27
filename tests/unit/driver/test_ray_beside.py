"""The embedded Ray starts beside the driver's imports and checks
(``ray_connection.embedded_ray_beside``), and never outlives a run that ends before it
connects. ``ray.init`` and ``ray.shutdown`` are stood in: no Ray runs."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import ray
from ray._private.node import Node

from raytrain_app import cli
from raytrain_app.config import load_config
from raytrain_app.driver import executors, launch, ray_connection
from raytrain_app.driver.ray_connection import embedded_ray_beside, ray_session
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.driver.run_lease import hold_run_lease
from raytrain_app.errors import BadInputError, RunFailedError
from raytrain_app.planning.environment import Resources, detect_environment

SMALL_DATA = ["--set", "data.params.num_turbines=1", "--set", "data.params.num_hours=500"]
WAIT_S = 30  # for the other thread's step; only a start that never comes waits this long


class StoodInRay:
    """``ray.init`` / ``ray.shutdown`` recording what happens, in order, in ``events``.
    ``init`` sets ``begun``, then waits for ``release`` (set by the test) where ``hold``
    is set."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.calls: list[dict] = []
        self.up = False
        self.hold = False
        self.begun = threading.Event()
        self.release = threading.Event()
        self.fail: Exception | None = None

    def init(self, **kwargs) -> None:
        self.events.append("init_start")
        self.calls.append(kwargs)
        self.init_thread = threading.current_thread()
        self.begun.set()
        if self.hold:
            assert self.release.wait(WAIT_S), "the test never released ray.init"
        if self.fail is not None:
            raise self.fail
        self.up = True
        self.events.append("init_end")

    def shutdown(self) -> None:
        self.events.append("shutdown")
        self.up = False
        self.starter_alive_at_shutdown = self.init_thread.is_alive()


class TrainerStarted(Exception):
    """Raised by the stand-in trainer: the run got past every check and connected."""


@pytest.fixture
def stood_in(monkeypatch, tmp_path) -> StoodInRay:
    ray_ = StoodInRay()
    monkeypatch.setattr(ray, "init", ray_.init)
    monkeypatch.setattr(ray, "shutdown", ray_.shutdown)
    monkeypatch.setattr(ray, "is_initialized", lambda: ray_.up)
    cluster = Resources(cpus=2.0, gpus=0.0, nodes=1, source="ray cluster")
    monkeypatch.setattr(ray_connection, "ray_cluster_resources", lambda: (cluster, None))
    monkeypatch.setattr(launch, "check_shared", lambda *args: None)  # asks Ray's nodes

    def trainer_started(*args, **kwargs):
        ray_.events.append("trainer")
        raise TrainerStarted

    monkeypatch.setattr(executors, "run_trainer", trainer_started)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # Ray's token file goes there
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)  # train() sets Ray Train's variables
    yield ray_
    os.environ.clear()
    os.environ.update(saved)


def checks_recorded(monkeypatch, ray_: StoodInRay, raises: BaseException | None = None) -> None:
    """``Launch.checked``'s check of the model and data waits until ``ray.init`` has begun,
    records itself and lets a held ``ray.init`` go on, then raises ``raises`` if given."""
    original = launch.check_sources

    def check_sources(*args, **kwargs):
        assert ray_.begun.wait(WAIT_S), "ray.init had not begun when the checks ran"
        ray_.events.append("checks")
        ray_.release.set()
        if raises is not None:
            raise raises
        return original(*args, **kwargs)

    monkeypatch.setattr(launch, "check_sources", check_sources)


def test_ray_starts_beside_the_checks_not_after_them(stood_in, monkeypatch):
    # Before: Ray's start (5 s cold) began only once the imports and checks (3 s) were done.
    stood_in.hold = True  # ray.init goes on only once the checks ran
    checks_recorded(monkeypatch, stood_in)
    with pytest.raises(TrainerStarted):
        cli.main(["train", "--no-progress", *SMALL_DATA])
    assert stood_in.events == ["init_start", "checks", "init_end", "trainer", "shutdown"]
    assert ray_connection.embedded_ray_starting() is False


@pytest.mark.parametrize(
    ("raised", "code"),
    [(BadInputError("model.target: no such factory; fix it"), 2), (KeyboardInterrupt(), 130)],
    ids=["bad_input", "ctrl_c"],
)
def test_a_run_refused_or_interrupted_while_ray_starts_stops_that_ray(
    stood_in, monkeypatch, capsys, tmp_path, raised, code
):
    stood_in.hold = True
    checks_recorded(monkeypatch, stood_in, raises=raised)
    assert cli.main(["train", "--no-progress", *SMALL_DATA]) == code
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    # The start is waited for, then shut down: no Ray is left running, none is taken over.
    assert stood_in.events == ["init_start", "checks", "init_end", "shutdown"]
    assert not stood_in.up and not ray_connection.embedded_ray_starting()
    assert not (tmp_path / "runs").exists()


def test_the_ray_started_beside_is_the_ray_a_session_starts_and_is_taken_over_once(
    stood_in, monkeypatch
):
    monkeypatch.setenv("RAYTRAIN_DASHBOARD_HOST", "0.0.0.0")
    with ray_session(None, detect_environment()):
        pass
    alone = stood_in.calls.pop()
    stood_in.events.clear()
    with embedded_ray_beside(), ray_session(None, detect_environment()) as env:
        assert env.resources.source == "this machine"  # planned as an embedded Ray
        assert stood_in.events == ["init_start", "init_end"]  # started once, not again
    assert stood_in.events == ["init_start", "init_end", "shutdown"]
    assert stood_in.calls == [alone]  # num_cpus, dashboard_host, loopback
    # Ray's processes die with the thread that started them: it outlives that Ray.
    assert stood_in.init_thread is not threading.main_thread()
    assert stood_in.starter_alive_at_shutdown and not stood_in.init_thread.is_alive()


def test_a_ray_that_fails_to_start_beside_is_one_line_as_before(stood_in):
    rays_own = Node.start_api_server
    stood_in.fail = RuntimeError("Failed to start the dashboard\nsecond line")
    with (
        pytest.raises(
            RunFailedError, match="^could not start or reach a local Ray: Failed to"
        ) as raised,
        embedded_ray_beside(),
        ray_session(None, detect_environment()),
    ):
        pass
    assert "\n" not in str(raised.value)
    assert "shutdown" not in stood_in.events
    assert Node.start_api_server is rays_own  # the dashboard's start is Ray's own again


@pytest.mark.parametrize(
    ("kwargs", "variables", "up"),
    [
        ({"local": True}, {}, False),
        ({"address": "10.0.0.1:6379"}, {}, False),
        ({}, {"RAY_ADDRESS": "10.0.0.1:6379"}, False),
        ({}, {}, True),
    ],
    ids=["local_mode", "address", "ray_address_variable", "ray_already_up"],
)
def test_nothing_starts_beside_a_run_that_starts_no_ray_here(
    stood_in, monkeypatch, kwargs, variables, up
):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    stood_in.up = up
    with embedded_ray_beside(**kwargs):
        assert not ray_connection.embedded_ray_starting()
    assert stood_in.events == []


def test_sigterm_while_ray_starts_beside_exits_through_its_shutdown(stood_in):
    # ray.init sets this handler in the main thread; started from another it cannot.
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited, embedded_ray_beside():
        assert stood_in.begun.wait(WAIT_S)
        os.kill(os.getpid(), signal.SIGTERM)
    assert exited.value.code == signal.SIGTERM
    assert stood_in.events == ["init_start", "init_end", "shutdown"]
    assert signal.getsignal(signal.SIGTERM) == before  # put back


def test_a_run_directory_another_run_writes_is_refused_before_a_ray_starts_for_it(
    stood_in, capsys, tmp_path
):
    # A second terminal's run of the same directory is refused at once, not after starting
    # (and stopping) a Ray of its own beside its imports, while the first run trains.
    cfg = load_config(None, [])
    root = RunDirectory.for_config(cfg).location.uri
    with hold_run_lease(root, "train", heartbeat_s=0.05, stale_after_s=30.0):
        assert cli.main(["train", "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: run directory '{tmp_path / 'runs' / 'quickstart'}' is being")
    assert stood_in.events == []


@pytest.mark.parametrize(
    "target",
    ["no_such_module_for_raytrain:build_model", "no_such_package_for_raytrain.models:build"],
    ids=["module", "package"],
)
def test_a_model_target_not_on_the_path_is_refused_before_a_ray_starts_for_it(
    stood_in, capsys, tmp_path, target
):
    # A misspelt module was refused only once the driver imported it, after starting (and
    # then stopping) a Ray for the run beside its imports: seconds for one line.
    assert cli.main(["train", "--no-progress", "--set", f"model.target={target}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: model.target='{target}' cannot be imported (No module")
    assert line.endswith("install the package or add its directory to PYTHONPATH")
    assert stood_in.events == []
    assert not (tmp_path / "runs").exists()


class TunerStarted(Exception):
    """Raised by the stand-in tuner: the sweep got past every check and connected."""


def test_a_sweep_starts_its_ray_beside_its_checks_too(stood_in, monkeypatch):
    # `raytrain tune` imported Tune and torch and checked the sweep before Ray's start began.
    from raytrain_app.sweep import tuning

    def tuner_started(*args, **kwargs):
        stood_in.events.append("tuner")
        raise TunerStarted

    monkeypatch.setattr(tuning, "build_tuner", tuner_started)
    stood_in.hold = True
    checks_recorded(monkeypatch, stood_in)
    with pytest.raises(TunerStarted):
        cli.main(["tune", *SMALL_DATA])
    assert stood_in.events == ["init_start", "checks", "init_end", "tuner", "shutdown"]
    assert ray_connection.embedded_ray_starting() is False


def test_a_sweep_directory_another_sweep_writes_is_refused_before_a_ray_starts_for_it(
    stood_in, capsys
):
    cfg = load_config(None, [], builtin="wind_sweep.yaml")
    root = RunDirectory.for_config(cfg).location.uri
    with hold_run_lease(root, "tune", heartbeat_s=0.05, stale_after_s=30.0):
        assert cli.main(["tune"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: run directory ") and "is being" in line
    assert stood_in.events == []
