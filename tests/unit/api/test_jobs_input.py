"""`raytrain submit` / `raytrain jobs`: bad input is refused before any cluster is contacted."""

from __future__ import annotations

import os
import shlex
import zipfile

import pytest

from raytrain_app import cli, jobs


@pytest.fixture
def no_cluster(monkeypatch, tmp_path):
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text("train: {epochs: 1}\n")
    return tmp_path


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["submit", "--", "train"], "pass --address http://HEAD:8265"),
        (["jobs", "list"], "pass --address http://HEAD:8265"),
        (["submit", "--address", "http://x:1", "--", "plan"], "submit runs one of train, tune"),
        (["submit", "--address", "http://x:1"], "got nothing"),
        (
            ["submit", "--address", "http://x:1", "--", "train", "--config", "nope.yaml"],
            "--config 'nope.yaml' does not exist",
        ),
        (
            ["submit", "--address", "http://x:1", "--working-dir", "missing", "--", "train"],
            "--working-dir 'missing' is not a directory",
        ),
    ],
)
def test_bad_submissions_exit_2_with_one_line(no_cluster, capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in one_error_line(capsys)


def test_a_config_outside_the_working_dir_is_refused(no_cluster, capsys, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "other.yaml"
    outside.write_text("train: {epochs: 1}\n")
    argv = ["submit", "--address", "http://x:1", "--", "train", "--config", str(outside)]
    assert cli.main(argv) == 2
    assert "outside the working directory" in one_error_line(capsys)


def test_unreachable_job_server_names_the_address(no_cluster, capsys):
    assert cli.main(["jobs", "--address", "http://127.0.0.1:1", "list"]) == 2
    line = one_error_line(capsys)
    assert "--address http://127.0.0.1:1: nothing is listening on 127.0.0.1:1" in line


# ------------------------------------------------------------------ what a job is sent
# A job's runtime env is readable by whoever holds the cluster's token: it carries only the
# variables the user names and the S3 variables a run in S3 needs (issue 29).

SHELL_AWS = {
    "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "secret-key-value",
    "AWS_SESSION_TOKEN": "session-token-value",
    "AWS_DEFAULT_REGION": "eu-west-1",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    # This machine's files and profiles: they name nothing on the cluster.
    "AWS_PROFILE": "laptop",
    "AWS_CONFIG_FILE": "/home/me/.aws/config",
    "AWS_SHARED_CREDENTIALS_FILE": "/home/me/.aws/credentials",
    "AWS_CA_BUNDLE": "/home/me/corp-ca.pem",
}
S3_SENT = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
}


class _RecordingClient:
    """A job server that records what it is sent."""

    def __init__(self) -> None:
        self.jobs: list[dict] = []

    def submit_job(self, **job) -> str:
        self.jobs.append(job)
        return "raysubmit_1"


@pytest.fixture
def cluster(no_cluster, monkeypatch):
    """A recording job server, and a shell with AWS variables and one secret of its own."""
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in {**SHELL_AWS, "MY_API_KEY": "my-api-key-value"}.items():
        monkeypatch.setenv(name, value)
    client = _RecordingClient()
    monkeypatch.setattr(jobs, "_client", lambda address: client)
    return client


def submit(capsys, *args: str) -> str:
    """``raytrain submit --no-wait ARGS`` to the recording job server, which must take it;
    returns what it logged (raytrain's log lines go to stderr)."""
    argv = ["submit", "--address", "http://x:1", "--no-wait", *args]
    code = cli.main(argv)
    logged = capsys.readouterr().err
    assert code == 0, logged
    return logged


def test_a_job_gets_no_variable_of_this_shell_unless_named(cluster, capsys):
    submit(capsys, "--", "train", "--set", "experiment.output_dir=/shared/runs")
    (job,) = cluster.jobs
    assert job["runtime_env"]["env_vars"] == {}


def test_a_named_variable_goes_with_the_job(cluster, capsys):
    submit(capsys, "--env-var", "MY_API_KEY", "--env-var", "AWS_PROFILE", "--", "train")
    (job,) = cluster.jobs
    assert job["runtime_env"]["env_vars"] == {
        "MY_API_KEY": "my-api-key-value",
        "AWS_PROFILE": "laptop",
    }


@pytest.mark.parametrize(
    "where",
    [
        ["--set", "experiment.output_dir=s3://bucket/runs"],
        ["--set", "data.path=s3://bucket/data/*.parquet", "--set", "data.params={}"],
        ["--set", "data.cache_dir=s3://bucket/cache"],  # issue 37: was sent nothing
    ],
    ids=["run_directory", "data", "cache"],
)
def test_a_run_in_s3_gets_the_s3_credentials_and_nothing_of_this_machine(cluster, capsys, where):
    logged = submit(capsys, "--", "train", *where)
    (job,) = cluster.jobs
    sent = job["runtime_env"]["env_vars"]
    assert set(sent) == S3_SENT
    assert all(sent[name] == SHELL_AWS[name] for name in sent)
    # The names are logged, never a value.
    assert "AWS_SECRET_ACCESS_KEY" in logged and "in S3" in logged
    assert not any(value in logged for value in SHELL_AWS.values())


def test_a_run_in_another_store_gets_no_credentials_and_says_how_to_send_some(cluster, capsys):
    logged = submit(capsys, "--", "tune", "--set", "experiment.output_dir=gs://bucket/runs")
    (job,) = cluster.jobs
    assert job["runtime_env"]["env_vars"] == {}
    (line,) = [line for line in logged.splitlines() if "experiment.output_dir" in line]
    assert "Google Cloud Storage" in line and "--env-var NAME" in line


def test_a_config_with_credentials_in_a_uri_is_refused_before_anything_is_sent(cluster, capsys):
    # issue 37: the job's entrypoint (its metadata) and the run's files would hold them
    uri = "https://me:hunter2@mlflow.example"
    argv = [
        "train",
        "--set",
        "tracking.mlflow=true",
        "--set",
        f"tracking.mlflow_tracking_uri={uri}",
    ]
    assert cli.main(["submit", "--address", "http://x:1", "--no-wait", "--", *argv]) == 2
    line = one_error_line(capsys)
    assert "'tracking.mlflow_tracking_uri': 'https://***@mlflow.example'" in line
    assert "MLFLOW_TRACKING_PASSWORD" in line and "hunter2" not in line
    assert cluster.jobs == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env-var", "NOT_SET_ANYWHERE"], "--env-var NOT_SET_ANYWHERE is not set in this shell"),
        (
            ["--env-var", "MY_API_KEY=typed-secret"],
            "--env-var takes a variable's name, not 'MY_API_KEY=...'",
        ),
        (["--env-var", "no-dashes"], "--env-var 'no-dashes' is not a variable name"),
    ],
)
def test_a_bad_env_var_is_refused_before_anything_is_sent(cluster, capsys, argv, message):
    assert cli.main(["submit", "--address", "http://x:1", *argv, "--", "train"]) == 2
    line = one_error_line(capsys)
    assert message in line and "typed-secret" not in line
    assert cluster.jobs == []


@pytest.mark.parametrize(
    "spelling",
    [
        ["--config", "{path}"],
        ["--config={path}"],
        ["--conf", "{path}"],
        ["--conf={path}"],
        ["-c", "{path}"],
        ["-c{path}"],
        ["-c={path}"],
    ],
)
def test_every_spelling_of_config_is_rewritten_for_the_job(cluster, capsys, no_cluster, spelling):
    path = str(no_cluster / "my.yaml")
    args = [arg.format(path=path) for arg in spelling]
    submit(capsys, "--", "train", *args, "--set", "train.epochs=2")
    (job,) = cluster.jobs
    # What raytrain on the cluster makes of the entrypoint: the path relative to the job's
    # working directory, the override kept.
    program, *args = shlex.split(job["entrypoint"])
    parsed = cli.build_parser().parse_args(args)
    assert program == "raytrain" and parsed.command == "train"
    assert parsed.config == "my.yaml" and parsed.overrides == ["train.epochs=2"]


@pytest.mark.parametrize("spelling", ["--config={path}", "-c{path}", "--conf={path}"])
def test_every_spelling_of_a_config_outside_the_working_dir_is_refused(
    cluster, capsys, tmp_path_factory, spelling
):
    outside = tmp_path_factory.mktemp("elsewhere") / "other.yaml"
    outside.write_text("train: {epochs: 1}\n")
    argv = ["submit", "--address", "http://x:1", "--", "train", spelling.format(path=outside)]
    assert cli.main(argv) == 2
    assert "outside the working directory" in one_error_line(capsys)
    assert cluster.jobs == []


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["train", "--bogus"], "unrecognized arguments: --bogus"),
        (["train", "--config"], "argument --config/-c: expected one argument"),
        (["train", "--set", "train.lrr=1"], "unknown config key 'train.lrr'"),
        (["train", "--help"], "--help and --version are not for a job"),
    ],
)
def test_a_command_raytrain_would_refuse_is_refused_before_it_is_sent(
    cluster, capsys, command, message
):
    assert cli.main(["submit", "--address", "http://x:1", "--", *command]) == 2
    assert message in one_error_line(capsys)
    assert capsys.readouterr().out == ""  # no help text either
    assert cluster.jobs == []


def test_token_and_dotenv_files_stay_out_of_the_upload(
    cluster, capsys, no_cluster, tmp_path_factory
):
    """What Ray itself would pack from the working dir, with the excludes the job is sent."""
    from ray._private.runtime_env.packaging import create_package

    secrets = ["cluster/ray-token", "auth_token", "deploy/prod.token", ".env", "sub/.env.local"]
    for name in [*secrets, "configs/keep.yaml", "my_pkg/model.py"]:
        (no_cluster / name).parent.mkdir(parents=True, exist_ok=True)
        (no_cluster / name).write_text("x\n")
    submit(capsys, "--", "train", "--config", "my.yaml")
    (job,) = cluster.jobs
    package = tmp_path_factory.mktemp("pkg") / "job.zip"
    runtime_env = job["runtime_env"]
    create_package(
        runtime_env["working_dir"],
        package,
        include_gitignore=False,
        excludes=runtime_env["excludes"],
    )
    with zipfile.ZipFile(package) as packed:
        names = set(packed.namelist())
    assert {"my.yaml", "configs/keep.yaml", "my_pkg/model.py"} <= names
    assert not names & set(secrets), names & set(secrets)
