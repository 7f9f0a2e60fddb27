"""raytrain_app.testing.s3_server: moto's S3 server on loopback, as pyarrow and boto3 use it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("moto", reason="the S3 test server needs moto[server] (the dev extra)")

import boto3  # moto brings it
import botocore.exceptions

from raytrain_app.testing.s3_server import S3Server, start_s3_server

# What a run directory on S3 does: write and read through pyarrow, configured only by the
# environment (``FileSystem.from_uri`` reads AWS_ENDPOINT_URL).
PYARROW_ROUND_TRIP = """
import sys
from pyarrow import fs
filesystem, path = fs.FileSystem.from_uri(sys.argv[1])
with filesystem.open_output_stream(path + "/a.txt") as out:
    out.write(b"hello")
with filesystem.open_input_stream(path + "/a.txt") as stream:
    print(type(filesystem).__name__, stream.read().decode())
"""


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> S3Server:
    server = start_s3_server(bucket="runs", log_path=tmp_path_factory.mktemp("s3") / "moto.log")
    yield server
    server.stop()


def client(server: S3Server):
    env = server.env()
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


def test_pyarrow_writes_and_reads_through_the_environment_alone(s3):
    assert s3.endpoint_url.startswith("http://127.0.0.1:")
    result = subprocess.run(
        [sys.executable, "-c", PYARROW_ROUND_TRIP, s3.uri("run1")],
        env={**os.environ, **s3.env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.split() == ["S3FileSystem", "hello"], result.stderr
    listed = client(s3).list_objects_v2(Bucket="runs", Prefix="run1/")
    assert [item["Key"] for item in listed["Contents"]] == ["run1/a.txt"]


def test_a_conditional_put_on_an_existing_key_is_refused(s3):
    """The run-directory lease relies on it: ``If-None-Match: *`` creates a key only once."""
    s3_client = client(s3)
    s3_client.put_object(Bucket="runs", Key="lease", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        s3_client.put_object(Bucket="runs", Key="lease", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3_client.get_object(Bucket="runs", Key="lease")["Body"].read() == b"first"


def test_stop_ends_the_server():
    server = start_s3_server(bucket="other")
    server.stop()
    assert server.process.poll() is not None


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(monkeypatch):
    """Before: the server exited at once on a port another process bound after it was picked
    (in CI, a Ray worker of the suite running beside), and the test using it failed."""
    import socket

    from raytrain_app.testing import s3_server
    from raytrain_app.testing.ports import free_ports

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy_port = taken.getsockname()[1]
    picks = iter([[busy_port]])
    monkeypatch.setattr(
        s3_server, "free_ports", lambda count: next(picks, None) or free_ports(count)
    )
    try:
        with pytest.raises(RuntimeError, match="exited before it answered"):
            start_s3_server(port=busy_port, bucket="named")  # a named port is tried once
        server = start_s3_server(bucket="picked")
    finally:
        taken.close()
    try:
        assert not server.endpoint_url.endswith(f":{busy_port}")
        assert "Buckets" in client(server).list_buckets()
    finally:
        server.stop()
