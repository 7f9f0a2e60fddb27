"""The run's storage: local paths and object-store URIs behind one small class, and the
node-local staging folder rank 0 writes in; round trips through a real S3 protocol server."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain_app.errors import BadInputError
from raytrain_app.storage import StagingDirectory, StorageLocation, is_uri
from raytrain_app.storage.location import has_credentials, redact_credentials
from raytrain_app.testing.s3_server import s3_for_this_process


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server; this process's AWS_* variables point at it."""
    with s3_for_this_process("unit") as server:
        yield server


def test_a_local_path_is_made_absolute_and_kept_as_the_users_string(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    relative = StorageLocation.parse("runs/exp", "experiment.output_dir")
    assert relative.is_local and relative.local_path == tmp_path / "runs" / "exp"
    assert relative.uri == str(tmp_path / "runs" / "exp") == str(relative)
    home = StorageLocation.parse("~/runs", "experiment.output_dir")
    assert home.local_path == tmp_path / "home" / "runs"
    assert StorageLocation.parse(Path("a") / "b", "data.path").child("c").local_path == (
        tmp_path / "a" / "b" / "c"
    )
    assert StorageLocation.parse(f"file://{tmp_path}/x", "data.path").local_path == tmp_path / "x"
    assert not is_uri("runs/exp") and not is_uri(r"C:\runs") and is_uri("s3://b/x")


def test_an_s3_uri_names_the_bucket_path_and_keeps_the_uri_for_children(s3):
    location = StorageLocation.parse("s3://unit/runs/", "experiment.output_dir")
    assert isinstance(location.filesystem, pafs.S3FileSystem) and not location.is_local
    assert (location.path, location.uri) == ("unit/runs", "s3://unit/runs")
    child = location.child("exp", "config.yaml")
    assert (child.path, child.uri, child.name) == (
        "unit/runs/exp/config.yaml",
        "s3://unit/runs/exp/config.yaml",
        "config.yaml",
    )
    assert location.at("unit/runs/exp").uri == "s3://unit/runs/exp"
    with pytest.raises(ValueError):
        _ = location.local_path


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("nosuch://bucket/runs", "experiment.output_dir"),
        ("ftp2://host/data/*.parquet", "data.path"),
        ("s3://", "--checkpoint"),
    ],
)
def test_a_uri_pyarrow_cannot_open_is_a_one_line_error_naming_the_key(text, key):
    with pytest.raises(BadInputError) as info:
        StorageLocation.parse(text, key)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{key}={text!r}") and "s3://bucket/prefix" in message


def test_files_round_trip_through_s3(s3):
    run = StorageLocation.parse(s3.uri("round-trip"), "experiment.output_dir")
    assert not run.exists() and run.list_dir() == []
    run.child("config.yaml").write_text("train: {lr: 0.1}\n")
    run.child("checkpoints", "c1", "model.pt").write_bytes(b"\x00\x01")
    assert run.is_dir() and run.child("config.yaml").is_file()
    assert run.child("config.yaml").read_text() == "train: {lr: 0.1}\n"
    assert run.child("checkpoints", "c1", "model.pt").read_bytes() == b"\x00\x01"
    assert [item.name for item in run.list_dir()] == ["checkpoints", "config.yaml"]
    assert [item.uri for item in run.list_dir(recursive=True) if item.is_file()] == [
        s3.uri("round-trip", "checkpoints", "c1", "model.pt"),
        s3.uri("round-trip", "config.yaml"),
    ]
    run.child("checkpoints").delete()
    assert not run.child("checkpoints").exists() and run.child("config.yaml").exists()
    run.child("absent").delete()  # nothing to do


def test_directories_upload_and_download_through_s3(s3, tmp_path):
    source = tmp_path / "source"
    (source / "tensorboard").mkdir(parents=True)
    (source / "metrics.csv").write_text("epoch\n1\n")
    (source / "tensorboard" / "events.1").write_bytes(b"event")
    remote = StorageLocation.parse(s3.uri("uploads", "run"), "experiment.output_dir")
    remote.upload(source)
    copy = remote.download(tmp_path / "copy")
    assert copy == tmp_path / "copy"
    assert (copy / "metrics.csv").read_text() == "epoch\n1\n"
    assert (copy / "tensorboard" / "events.1").read_bytes() == b"event"
    one = remote.child("metrics.csv").download(tmp_path / "one")
    assert one == tmp_path / "one" / "metrics.csv" and one.read_text() == "epoch\n1\n"


def test_a_local_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    target = StorageLocation.parse(tmp_path / "run" / "summary.json", "experiment.output_dir")
    target.write_text("old")
    target.write_text("new")
    assert target.read_text() == "new"
    assert os.listdir(tmp_path / "run") == ["summary.json"]


def test_local_staging_is_the_directory_itself(tmp_path):
    staging = StagingDirectory(StorageLocation.local(tmp_path / "run"), ["metrics.csv"])
    assert staging.local == tmp_path / "run" and staging.local.is_dir()
    (staging.local / "metrics.csv").write_text("epoch\n")
    staging.close()
    assert (tmp_path / "run" / "metrics.csv").read_text() == "epoch\n"


def test_remote_staging_resumes_its_own_files_and_uploads_what_changed(s3):
    run = StorageLocation.parse(s3.uri("staged"), "experiment.output_dir")
    run.child("metrics.csv").write_text("epoch\n1\n")
    run.child("tensorboard", "events.1").write_bytes(b"first")
    run.child("checkpoints", "c1", "model.pt").write_bytes(b"big")
    staging = StagingDirectory(run, ["metrics.csv", "tensorboard"])
    local = staging.local
    assert not str(local).startswith(str(Path.cwd()))
    # The files this process owns come back (a resume on another node); others do not.
    assert (local / "metrics.csv").read_text() == "epoch\n1\n"
    assert (local / "tensorboard" / "events.1").read_bytes() == b"first"
    assert not (local / "checkpoints").exists()
    with (local / "metrics.csv").open("a") as handle:
        handle.write("2\n")
    (local / "tensorboard" / "events.2").write_bytes(b"second")
    staging.sync()
    assert run.child("metrics.csv").read_text() == "epoch\n1\n2\n"
    assert run.child("tensorboard", "events.2").read_bytes() == b"second"
    (local / "wandb").mkdir()
    (local / "wandb" / "run.wandb").write_bytes(b"offline")
    staging.close()
    assert run.child("wandb", "run.wandb").read_bytes() == b"offline"
    assert not local.exists()
    assert run.child("checkpoints", "c1", "model.pt").read_bytes() == b"big"


def test_parquet_data_in_a_bucket_resolves_by_file_prefix_and_glob(s3, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_app.data.parquet_source import check_files, read_table, resolve_paths

    local = tmp_path / "part.parquet"
    pq.write_table(pa.table({"x": [1.0, 2.0], "y": [3, 4]}), local)
    for name in ("a/one.parquet", "a/b/two.parquet"):
        StorageLocation.parse(s3.uri("data", name), "data.path").upload(local)
    StorageLocation.parse(s3.uri("data", "a", "notes.txt"), "data.path").write_text("x")

    def uris(path):
        return [str(f) for f in resolve_paths(path)]

    one, two = s3.uri("data", "a", "one.parquet"), s3.uri("data", "a", "b", "two.parquet")
    assert uris(one) == [one]
    assert uris(s3.uri("data", "a")) == [two, one]
    assert uris(s3.uri("data", "a", "*.parquet")) == [two, one]  # * crosses /, as fnmatch
    assert uris(s3.uri("data", "a", "o*.parquet")) == [one]
    files = check_files(s3.uri("data", "a"), ["x", "y"])
    assert read_table(files, ["x"]).column("x").to_pylist() == [1.0, 2.0, 1.0, 2.0]
    with pytest.raises(BadInputError, match="No Parquet files match data path"):
        resolve_paths(s3.uri("data", "none", "*.parquet"))


# --------------------------------------------------------------------------- hostile keys


def _put_raw(s3, *keys: str) -> None:
    """Objects under keys that pyarrow would normalise, put as a hostile writer would."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint_url)
    for key in keys:
        client.put_object(Bucket=s3.bucket, Key=key, Body=b"payload")


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize(
    "key",
    ["../../../escaped/evil.txt", "sub/../../../../escaped/evil.txt", "/escaped/evil.txt", "./x"],
    ids=["dot_dot", "dot_dot_inside", "absolute", "dot"],
)
def test_a_download_refuses_a_key_that_leaves_its_folder_and_writes_nothing(s3, tmp_path, key):
    # before, '..' keys made directories outside the download folder, then a traceback
    prefix = f"{tmp_path.name}/ckpt"  # one prefix per case
    _put_raw(s3, f"{prefix}/model.pt", f"{prefix}/{key}")
    checkpoint = StorageLocation.parse(s3.uri(prefix), "--checkpoint")
    folder = tmp_path / "one" / "two" / "three"  # '../../../escaped' lands in tmp_path
    with pytest.raises(BadInputError) as info:
        checkpoint.download(folder)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{s3.uri(prefix)} holds the key '{s3.bucket}/{prefix}/{key}'")
    assert "remove or rename that object" in message
    assert _tree(tmp_path) == []


def test_listing_and_staging_refuse_a_key_with_dot_dot(s3, tmp_path):
    _put_raw(s3, "hostile-run/metrics.csv", "hostile-run/../escaped.csv")
    run = StorageLocation.parse(s3.uri("hostile-run"), "experiment.output_dir")
    with pytest.raises(BadInputError, match="holds the key 'unit/hostile-run/..'"):
        run.list_dir(recursive=True)
    with pytest.raises(BadInputError, match="holds the key"):
        StagingDirectory(run)
    with pytest.raises(BadInputError, match="holds the key '..'"):
        run.child("..")


def test_a_download_of_plain_keys_keeps_working(s3, tmp_path):
    _put_raw(s3, "plain/ckpt/model.pt", "plain/ckpt/shards/a..b/x.distcp")
    copy = StorageLocation.parse(s3.uri("plain", "ckpt"), "--checkpoint").download(tmp_path / "c")
    assert _tree(copy) == ["model.pt", "shards", "shards/a..b", "shards/a..b/x.distcp"]


# --------------------------------------------------------------------------- credentials

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY"


@pytest.mark.parametrize(
    "uri",
    [
        f"s3://AKIAEXAMPLE:{SECRET.replace('/', '')}@unit/runs",
        f"s3://AKIAEXAMPLE:{SECRET}@unit/runs",  # a '/' in the secret ends the host early
        "s3://AKIAEXAMPLE@unit/runs",
    ],
    ids=["key_and_secret", "secret_with_a_slash", "key_only"],
)
@pytest.mark.parametrize("key", ["experiment.output_dir", "--checkpoint", "data.path"])
def test_a_uri_with_credentials_is_refused_without_echoing_them(uri, key):
    # before: accepted (then the secret showed wherever the URI did) or echoed by the error
    with pytest.raises(BadInputError) as info:
        StorageLocation.parse(uri, key)
    message = str(info.value)
    assert message.startswith(f"{key}='s3://***@unit/runs': the URI carries credentials")
    assert "AWS_ACCESS_KEY_ID" in message and "\n" not in message
    assert "AKIAEXAMPLE" not in message and "wJalr" not in message


@pytest.mark.parametrize(
    "text",
    ["s3://bucket/runs/user@host/x", "hdfs://namenode:8020/data/a@b", "s3://bucket/k:v@w", "a@b:c"],
)
def test_an_at_sign_in_a_key_or_a_port_is_not_taken_for_credentials(text):
    assert not has_credentials(text) and redact_credentials(text) == text


def test_every_uri_with_credentials_in_a_text_is_redacted():
    text = "x='s3://k:s@b/p' from --set data.path=gs://k:s/t@b/q, http://u:p@host:5000/"
    assert redact_credentials(text) == (
        "x='s3://***@b/p' from --set data.path=gs://***@b/q, http://***@host:5000/"
    )
