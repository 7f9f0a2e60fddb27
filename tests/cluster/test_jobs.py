"""`raytrain submit` and `raytrain jobs` against a real token-auth Ray head (no mocks)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from paths import EXAMPLES

from raytrain_app.storage import StorageLocation
from raytrain_app.testing.processes import pids_naming
from raytrain_app.testing.s3_server import s3_for_this_process

pytestmark = pytest.mark.cluster

TINY = {
    "experiment": {"name": "job"},
    "data": {"params": {"num_turbines": 2, "num_hours": 1200, "stride": 4}},
    "train": {"epochs": 1},
    "scaling": {"num_workers": 2},
}


@pytest.fixture
def project(tmp_path) -> Path:
    """A user's project directory with a config, sent as the job's working directory."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "my.yaml").write_text(yaml.safe_dump(TINY))
    return root


def raytrain(args: list[str], env: dict, cwd: Path, timeout: float = 240):
    return subprocess.run(
        [sys.executable, "-m", "raytrain_app.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submit_train(head, cwd: Path, *overrides: str, flags: tuple[str, ...] = ()):
    """`raytrain submit [flags] -- train --config my.yaml --set ...` from ``cwd``."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    command = [
        "submit",
        "--address",
        head.dashboard_url,
        *flags,
        "--",
        "train",
        "--config",
        "my.yaml",
        *sets,
    ]
    return raytrain(command, head.client_env(), cwd)


def submitted_id(output: str) -> str:
    match = re.search(r"raysubmit_\w+", output)
    assert match, output
    return match.group(0)


@pytest.mark.compat
def test_a_train_job_succeeds_and_leaves_its_run_directory_in_a_bucket(ray_head, project, tmp_path):
    """The run directory in an object store: the job reaches it with the S3 credential,
    region and endpoint variables of the machine it was submitted from, and no others."""
    with s3_for_this_process("jobs", log_path=tmp_path / "moto.log") as s3:
        env = {**ray_head.client_env(), **s3.env()}
        submit = ["submit", "--address", ray_head.dashboard_url, "--", "train"]
        result = raytrain(
            [*submit, "--config", "my.yaml", "--set", f"experiment.output_dir={s3.uri('runs')}"],
            env,
            project,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCEEDED" in result.stdout
        assert "val_loss" in result.stdout  # the job's own output was streamed back
        run = StorageLocation.parse(s3.uri("runs", "job"), "test")
        summary = json.loads(run.child("summary.json").read_text())
        assert summary["world_size"] == 2 and summary["epochs_completed"] == 1
        # The token reached the job (the head's environment) but none of what it wrote.
        written = run.list_dir(True, True)
        names = {Path(item.path).name for item in written}
        assert {"config.yaml", "summary.json", "metrics.csv", "meta.json"} <= names
        token = ray_head.token.encode()
        assert [item.uri for item in written if token in item.read_bytes()] == []
    job_id = submitted_id(result.stdout)
    _, listed = _api_jobs(ray_head, {"Authorization": f"Bearer {ray_head.token}"})
    (job,) = [job for job in json.loads(listed) if job["submission_id"] == job_id]
    sent = set(job["runtime_env"]["env_vars"])
    assert sent == {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL",
        "AWS_REQUEST_CHECKSUM_CALCULATION",  # the S3 test server's, a setting, no secret
    }
    logs = raytrain(
        ["jobs", "--address", ray_head.dashboard_url, "logs", job_id],
        ray_head.client_env(),
        project,
    )
    assert "val_loss" in logs.stdout
    assert ray_head.token not in logs.stdout + result.stdout + result.stderr


def test_an_invalid_config_is_refused_before_anything_is_sent(ray_head, project):
    """The command is parsed and its config loaded as the job would, before submitting."""
    env = ray_head.client_env()
    listed = raytrain(["jobs", "--address", ray_head.dashboard_url, "list"], env, project)
    result = submit_train(ray_head, project, "train.lrr=0.1")
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: unknown config key 'train.lrr' (did you mean 'train.lr'?)")
    assert "raysubmit_" not in result.stdout
    again = raytrain(["jobs", "--address", ray_head.dashboard_url, "list"], env, project)
    assert again.stdout == listed.stdout  # no job was made


def test_a_job_that_fails_on_the_cluster_says_why_in_one_line(ray_head, project):
    """A config valid here whose data the cluster does not have: the job fails with the
    training's one-line error."""
    env = ray_head.client_env()
    missing = (
        "data.path=data/missing.parquet",
        "data.params={feature_columns: [x], target_column: y}",
    )
    result = submit_train(ray_head, project, *missing)
    assert result.returncode == 1, result.stdout + result.stderr
    job_id = submitted_id(result.stdout)
    status = raytrain(["jobs", "--address", ray_head.dashboard_url, "status", job_id], env, project)
    assert status.stdout.strip() == "FAILED"
    logs = raytrain(["jobs", "--address", ray_head.dashboard_url, "logs", job_id], env, project)
    (error,) = [line for line in logs.stdout.splitlines() if line.startswith("error: ")]
    assert "No Parquet files match data path 'data/missing.parquet'" in error, logs.stdout
    assert "Traceback" not in logs.stdout

    # --no-wait prints the job id alone and returns; the job runs (and fails) on its own.
    detached = submit_train(ray_head, project, *missing, flags=("--no-wait",))
    assert detached.returncode == 0, detached.stdout + detached.stderr
    assert re.fullmatch(r"raysubmit_\w+", detached.stdout.strip()), detached.stdout
    wait_for_status(ray_head.dashboard_url, detached.stdout.strip(), env, project, "FAILED", 120)


def test_without_the_token_the_cluster_refuses_with_a_clear_message(ray_head, project):
    result = raytrain(
        ["jobs", "--address", ray_head.dashboard_url, "list"],
        ray_head.client_env(with_token=False),
        project,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "requires token authentication" in lines[0]
    assert "RAY_AUTH_TOKEN" in lines[0]


def _api_jobs(head, headers: dict[str, str], body: dict | None = None) -> tuple[int, str]:
    """A raw request to the head's job API: POST ``body`` if given, else GET."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"{head.dashboard_url}/api/jobs/",
        data=data,
        headers={"Content-Type": "application/json", **headers},
        method="POST" if data else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_head_refuses_a_job_submission_without_the_token(ray_head):
    authorized = {"Authorization": f"Bearer {ray_head.token}"}
    status, listed = _api_jobs(ray_head, authorized)
    assert status == 200
    before = json.loads(listed)
    job = {"entrypoint": "echo never-run"}

    status, text = _api_jobs(ray_head, {}, job)
    assert status == 401 and "Missing authentication token" in text
    status, text = _api_jobs(ray_head, {"Authorization": "Bearer not-the-token"}, job)
    assert status == 403 and "Invalid authentication token" in text

    status, listed = _api_jobs(ray_head, authorized)
    after = json.loads(listed)
    assert len(after) == len(before)
    assert not any(j.get("entrypoint") == job["entrypoint"] for j in after)


def test_the_head_keeps_to_its_own_ports_and_its_client_server_is_found_by_them(ray_head):
    """Ray's default Ray Client port (10001) would be shared by every head on the machine;
    that process is also the one that does not name the head's temp dir (stop() finds it by
    its port, and the fixture checks nothing of the head outlives stop())."""
    client = pids_naming("ray.util.client.server", f"--port={ray_head.client_server_port}\0")
    assert len(client) == 1 and client[0] in ray_head.processes()


def test_an_unknown_job_id_is_a_clear_error(ray_head, project):
    result = raytrain(
        ["jobs", "--address", ray_head.dashboard_url, "status", "raysubmit_nope"],
        ray_head.client_env(),
        project,
    )
    assert result.returncode == 2
    assert "job 'raysubmit_nope' does not exist" in result.stderr


def wait_for_status(url: str, job_id: str, env: dict, cwd: Path, wanted: str, timeout: float):
    deadline = time.monotonic() + timeout
    while (
        state := raytrain(["jobs", "--address", url, "status", job_id], env, cwd).stdout.strip()
    ) != wanted:
        assert time.monotonic() < deadline, f"{job_id} is {state}, never {wanted}"
        time.sleep(1)


def test_user_code_travels_with_a_job_that_ctrl_c_leaves_running_then_list_logs_and_stop_it(
    ray_head, tmp_path
):
    """One long job of the user package in examples/, sent as the working directory:
    Ctrl-C stops watching it, never the job; `raytrain jobs` then lists it, shows the
    epochs the user's model trained, its status, and stops it."""
    import signal

    env, url = ray_head.client_env(), ray_head.dashboard_url
    command = [sys.executable, "-m", "raytrain_app.cli", "submit", "--address", url]
    command += ["--working-dir", str(EXAMPLES), "--"]
    command += ["train", "--config", str(EXAMPLES / "sine.yaml"), "--set", "train.epochs=500"]
    command += ["--set", "experiment.name=watched"]
    command += ["--set", f"experiment.output_dir={tmp_path / 'runs'}"]
    with subprocess.Popen(
        command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        job_id = submitted_id(proc.stdout.readline())
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert f"{job_id} keeps running" in stderr and f"jobs --address {url} stop {job_id}" in stderr
    listed = raytrain(["jobs", "--address", url, "list"], env, tmp_path)
    assert job_id in listed.stdout
    deadline = time.monotonic() + 120
    while (
        "epoch 1/500"
        not in raytrain(["jobs", "--address", url, "logs", job_id], env, tmp_path).stdout
    ):
        assert time.monotonic() < deadline, "the job never logged its first epoch"
        time.sleep(2)
    status = raytrain(["jobs", "--address", url, "status", job_id], env, tmp_path)
    assert status.stdout.strip() == "RUNNING"
    assert (tmp_path / "runs" / "watched" / "metrics.csv").is_file()  # the user's model trains
    stop = raytrain(["jobs", "--address", url, "stop", job_id], env, tmp_path)
    assert stop.returncode == 0 and "stopping" in stop.stdout
    wait_for_status(url, job_id, env, tmp_path, "STOPPED", timeout=60)
