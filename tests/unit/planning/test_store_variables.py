"""Which of the shell's variables go with a run (``planning.store_variables``): the S3
variables when any location of the config is in S3, ``data.cache_dir`` included, an MLflow
server's when MLflow logs to one, nothing otherwise; and every place that sends variables
(workers and Ray Train's controller, Tune trials, Ray Data's prepare tasks; a submitted job
in tests/unit/api/test_jobs_input.py) asks that one function. In process, no Ray."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from raytrain_app.config import config_from_dict
from raytrain_app.planning.environment import detect_environment
from raytrain_app.planning.store_variables import s3_keys, storage_env_vars

S3_SET = {
    "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "secret-key-value",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
}
# This machine's files and profiles: they name nothing on the cluster, never sent.
MACHINE_SET = {
    "AWS_PROFILE": "laptop",
    "AWS_CONFIG_FILE": "/home/me/.aws/config",
    "AWS_SHARED_CREDENTIALS_FILE": "/home/me/.aws/credentials",
    "AWS_CA_BUNDLE": "/home/me/corp-ca.pem",
    "MLFLOW_TRACKING_SERVER_CERT_PATH": "/home/me/mlflow-ca.pem",
}
MLFLOW_SET = {"MLFLOW_TRACKING_USERNAME": "me", "MLFLOW_TRACKING_PASSWORD": "hunter2"}
LOCAL = ["experiment.output_dir=/shared/runs", "data.path=/shared/data/*.parquet"]


@pytest.fixture
def shell(monkeypatch):
    """A shell with S3 and MLflow credentials and this machine's AWS files set."""
    for name, value in {**S3_SET, **MACHINE_SET, **MLFLOW_SET}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def cfg_with(*overrides: str, data: dict | None = None):
    return config_from_dict(data or {}, [*LOCAL, "scaling.use_gpu=false", *overrides])


@pytest.mark.parametrize(
    ("where", "key"),
    [
        ("experiment.output_dir=s3://bucket/runs", "experiment.output_dir"),
        ("data.path=s3://bucket/data/*.parquet", "data.path"),
        # issue 37: the prepared cache in S3 with the run and data on a shared filesystem
        ("data.cache_dir=s3://bucket/cache", "data.cache_dir"),
        ("data.params={source: {url: s3://bucket/raw}}", "data.params.source.url"),
        (
            "tune.param_space={data.path: {choice: [/shared/a.parquet, s3://bucket/b.parquet]}}",
            "tune.param_space.data.path.choice",
        ),
    ],
    ids=["run_directory", "data", "cache", "factory_params", "swept_data"],
)
def test_a_location_in_s3_sends_the_s3_variables_and_nothing_of_this_machine(shell, where, key):
    cfg = cfg_with(where)
    assert s3_keys(cfg) == [key]
    assert storage_env_vars(cfg) == S3_SET


def test_a_run_with_no_location_in_s3_sends_nothing(shell):
    # before: every run sent the shell's AWS credentials to every worker, trial and task
    assert storage_env_vars(cfg_with()) == {}
    assert storage_env_vars(cfg_with("data.cache_dir=gs://bucket/cache")) == {}


def test_an_mlflow_server_gets_mlflows_variables_only_when_mlflow_logs_to_it(shell):
    server = "tracking.mlflow_tracking_uri=https://mlflow.example"
    assert storage_env_vars(cfg_with(server, "tracking.mlflow=true")) == MLFLOW_SET
    assert storage_env_vars(cfg_with(server, "tracking.mlflow=false")) == {}
    file_store = "tracking.mlflow_tracking_uri=file:///shared/mlruns"
    assert storage_env_vars(cfg_with(file_store, "tracking.mlflow=true")) == {}


# ------------------------------------------------------------------ the places that send them


class _Sent(Exception):
    """Raised by a stand-in where a site hands variables on, carrying them."""


def _record(name: str):
    """A stand-in that raises the keyword argument ``name`` (all of them for "kwargs")."""

    def stand_in(*args, **kwargs):
        raise _Sent(kwargs if name == "kwargs" else kwargs[name])

    return stand_in


def _sent(call) -> dict:
    with pytest.raises(_Sent) as sent:
        call()
    return sent.value.args[0]


CACHE_IN_S3 = "data.cache_dir=s3://bucket/cache"


@pytest.mark.parametrize(("where", "expected"), [([CACHE_IN_S3], S3_SET), ([], {})])
def test_ray_data_prepare_tasks_get_the_variables_the_config_needs(
    shell, monkeypatch, where, expected
):
    from raytrain_app.driver import preflight
    from raytrain_app.sweep import tuning

    cfg = cfg_with(*where)
    run_dir = SimpleNamespace(at=lambda name: None)
    monkeypatch.setattr(preflight, "prepare_data", _record("task_env"))
    assert _sent(lambda: preflight.preflight(cfg, run_dir, plan=None)) == expected
    monkeypatch.setattr(tuning, "prepare_data", _record("task_env"))
    launch = SimpleNamespace(cfg=cfg, run_dir=run_dir)
    assert _sent(lambda: tuning._prepare_data_once(launch)) == expected


@pytest.mark.parametrize(("where", "expected"), [([CACHE_IN_S3], S3_SET), ([], {})])
def test_tune_trials_get_the_variables_the_config_needs(
    shell, monkeypatch, tmp_path, where, expected
):
    from raytrain_app.sweep import tuner

    monkeypatch.setattr(tuner.tune, "with_parameters", _record("storage_env"))
    location = SimpleNamespace(is_local=True, uri=str(tmp_path))
    run_dir = SimpleNamespace(location=location, root=tmp_path)
    env = detect_environment({})
    build = lambda: tuner.build_tuner(cfg_with(*where), {}, run_dir, env, trust_code=False)  # noqa: E731
    assert _sent(build) == expected


@pytest.mark.parametrize(("where", "expected"), [([CACHE_IN_S3], S3_SET), ([], {})])
def test_workers_and_the_controller_get_the_variables_the_config_needs(
    shell, monkeypatch, tmp_path, where, expected
):
    from raytrain_app.driver import trainer

    @contextlib.contextmanager
    def control(progress):
        yield SimpleNamespace(actor=None, stop=threading.Event())

    monkeypatch.setattr(trainer, "DriverControl", control)
    monkeypatch.setattr(trainer, "RaytrainTorchTrainer", _record("kwargs"))
    plan = SimpleNamespace(
        worker_range=None,
        world_size=2,
        use_gpu=False,
        cpus_per_worker=1,
        backend="gloo",
        timeout_s=60,
    )
    checkpoints = SimpleNamespace(path=str(tmp_path), is_local=True)
    args = (SimpleNamespace(plan=plan), cfg_with(*where), checkpoints, False, True)
    sent = _sent(lambda: trainer.run_trainer(*args))
    workers = sent["run_config"].worker_runtime_env["env_vars"]
    assert {k: v for k, v in workers.items() if k.startswith("AWS_")} == expected
    assert sent["storage_env"] == expected  # what Ray Train's controller is lent
