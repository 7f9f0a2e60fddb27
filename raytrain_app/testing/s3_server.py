"""An S3-compatible server for tests and benchmarks: moto's standalone server with one bucket,
stopped by PID.

Run directories on object storage (``s3://bucket/prefix``) are tested against it as against a
real store: pyarrow and boto3 speak HTTP to it, and it refuses a conditional put
(``If-None-Match: *``) on a key that exists with 412 PreconditionFailed, as S3 does. The
credentials are dummies and every client is pointed at the one endpoint, so nothing is sent
anywhere else (``AWS_EC2_METADATA_DISABLED`` keeps the SDKs off the metadata address).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from raytrain_app.testing.ports import free_ports

START_TIMEOUT_S = 60.0  # moto imports every AWS service's model: slow on a loaded machine
STOP_GRACE_S = 5.0
_POLL_S = 0.2
_PORT_ATTEMPTS = 3

# moto accepts any key; these only have to be present so that no SDK looks further.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    # moto stores an aws-chunked upload (the SDK's default with trailing checksums) with
    # its framing, so a Parquet file written from a Ray task would lose its magic bytes.
    "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
}

# Run in the server's network namespace (``enter``): the caller may not reach the server.
_MAKE_BUCKET = (
    "import sys; from raytrain_app.testing.s3_server import make_bucket; "
    "make_bucket(sys.argv[1], sys.argv[2])"
)


class _ServerExited(RuntimeError):
    """The server process ended before it answered (on a picked port: most likely taken)."""


@dataclass
class S3Server:
    """A running server and what a client needs to reach it."""

    endpoint_url: str  # http://HOST:PORT
    bucket: str  # made at start
    process: subprocess.Popen = field(repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def env(self) -> dict[str, str]:
        """Variables that point boto3, pyarrow (``FileSystem.from_uri``) and the AWS CLI here."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, **CREDENTIALS}

    def uri(self, *parts: str) -> str:
        """``s3://<bucket>/<parts joined by />``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL it after a grace; returns once it has exited."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_GRACE_S)


def start_s3_server(
    host: str = "127.0.0.1",
    port: int | None = None,
    bucket: str = "runs",
    *,
    enter: Sequence[str] = (),
    log_path: Path | None = None,
) -> S3Server:
    """Start ``moto_server -H host -p port``; returns once ``bucket`` exists on it.

    Args:
        host: the address it listens on (loopback, or an address of the ``enter`` namespace).
        port: None picks one that is free on this machine's 127.0.0.1.
        bucket: the bucket made at start.
        enter: a command prefix that puts the server, and the client that makes the bucket,
            somewhere else: ``("nsenter", "-t", PID, "--net")`` runs both in that process's
            network namespace. It must exec the command (keep its PID), as ``nsenter --net``
            does, so that ``stop`` signals the server itself.
        log_path: where the server's output goes (discarded when None).
    """
    if port is not None:  # the caller's port: tried once
        return _start_on(host, port, bucket, enter, log_path)
    # A port picked here was free a moment ago; another process (a Ray worker of a suite
    # running beside) may bind it before the server does, and the server then exits at once.
    # So a picked port is picked again; the last attempt's failure is raised.
    for _ in range(_PORT_ATTEMPTS - 1):
        with contextlib.suppress(_ServerExited):
            return _start_on(host, free_ports(1)[0], bucket, enter, log_path)
    return _start_on(host, free_ports(1)[0], bucket, enter, log_path)


def _start_on(
    host: str, port: int, bucket: str, enter: Sequence[str], log_path: Path | None
) -> S3Server:
    server_command = [*enter, str(Path(sys.executable).parent / "moto_server")]
    env = _child_env()
    with open(log_path or os.devnull, "w") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [*server_command, "-H", host, "-p", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = S3Server(endpoint_url=f"http://{host}:{port}", bucket=bucket, process=process)
    try:
        _make_bucket_beside(server, enter, env, log_path)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def s3_for_this_process(bucket: str, log_path: Path | None = None) -> Iterator[S3Server]:
    """A server on loopback, with this process's AWS_* variables pointing at it (and so its
    children's, and Ray workers' when the driver passes them on); all put back after."""
    server = start_s3_server(bucket=bucket, log_path=log_path)
    saved = {name: os.environ.get(name) for name in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


def make_bucket(endpoint_url: str, bucket: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Create ``bucket`` once the server at ``endpoint_url`` answers (it may still be starting)."""
    import boto3
    import botocore.config
    import botocore.exceptions

    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        config=botocore.config.Config(connect_timeout=2, retries={"max_attempts": 1}),
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.create_bucket(Bucket=bucket)
            return
        except client.exceptions.BucketAlreadyOwnedByYou:
            return
        except (
            botocore.exceptions.EndpointConnectionError,
            botocore.exceptions.ConnectionClosedError,
        ):
            if time.monotonic() > deadline:
                raise
            time.sleep(_POLL_S)


def _make_bucket_beside(
    server: S3Server, enter: Sequence[str], env: dict[str, str], log_path: Path | None
) -> None:
    """Run ``make_bucket`` where the server runs; fail early if the server exits first."""
    maker = subprocess.Popen(
        [*enter, sys.executable, "-c", _MAKE_BUCKET, server.endpoint_url, server.bucket],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_S + 10
    where = f"; its output is in {log_path}" if log_path else ""
    try:
        while maker.poll() is None:
            if server.process.poll() is not None:
                raise _ServerExited(
                    f"the S3 server at {server.endpoint_url} exited before it answered "
                    f"(exit status {server.process.poll()}){where}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the S3 server at {server.endpoint_url} did not answer{where}")
            time.sleep(_POLL_S)
    finally:
        if maker.poll() is None:
            maker.kill()
        output = maker.communicate()[0]
    if maker.returncode != 0:
        raise RuntimeError(
            f"making bucket {server.bucket!r} at {server.endpoint_url} failed: {output[-2000:]}"
        )


def _child_env() -> dict[str, str]:
    """This environment without AWS or moto settings of the caller's, plus the dummies."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
    env.update(CREDENTIALS)
    return env
