"""The streaming prepare pass on Ray Data: the same bytes as in process, one-line errors, and
data and prepared store both in an object store (the S3 test server)."""

from __future__ import annotations

import pytest
from stream_data import PARAMS, ROWS_PER_GROUP, series_table, store_files, write_files

from raytrain_app.data import stream_prepare
from raytrain_app.data.stream_prepare import prepare_stream
from raytrain_app.errors import BadInputError
from raytrain_app.storage import StorageLocation
from raytrain_app.testing.s3_server import s3_for_this_process

pytestmark = pytest.mark.distributed


def prepare(path, cache, *, in_process: bool = False, **params):
    """``prepare_stream`` on the session's Ray, or in this process as if Ray were not up."""
    with pytest.MonkeyPatch.context() as patch:
        if in_process:
            patch.setattr(stream_prepare, "_ray_initialized", lambda: False)
        return prepare_stream(path, {**PARAMS, **params}, cache, rows_per_group=ROWS_PER_GROUP)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("src"), series_table())


@pytest.fixture(scope="module")
def in_process(source, tmp_path_factory):
    return prepare(str(source), tmp_path_factory.mktemp("here"), in_process=True)


def test_ray_data_writes_the_same_bytes_as_the_in_process_pass(
    ray_cluster, source, in_process, tmp_path
):
    on_ray = prepare(str(source), tmp_path)
    assert not on_ray.reused and on_ray.nodes and not in_process.nodes
    assert on_ray.manifest.to_json() == in_process.manifest.to_json()
    assert store_files(on_ray.location) == store_files(in_process.location)


def test_a_bad_series_in_a_ray_task_is_the_one_line_error(ray_cluster, tmp_path):
    source = write_files(tmp_path / "src", series_table(lengths={1: 100, 2: 20}))
    with pytest.raises(BadInputError) as error:
        prepare(str(source), tmp_path / "cache")
    assert type(error.value) is BadInputError
    assert str(error.value).startswith("A series has 20 timesteps but needs at least 46")
    assert "\n" not in str(error.value)


def test_data_and_store_in_an_object_store(ray_cluster, source, in_process, tmp_path):
    with s3_for_this_process("stream", log_path=tmp_path / "moto.log") as s3:
        StorageLocation.parse(s3.uri("data"), "t").upload(source)
        cache = StorageLocation.parse(s3.uri("prepared"), "t")
        on_ray = prepare(s3.uri("data"), cache)
        assert on_ray.location.startswith(s3.uri("prepared") + "/") and on_ray.nodes
        remote, local = store_files(on_ray.location), store_files(in_process.location)
        assert {k: v for k, v in remote.items() if k != "manifest.json"} == {
            k: v for k, v in local.items() if k != "manifest.json"
        }
        # the same store but for the key, which hashes the files' URIs and mtimes
        assert {**on_ray.manifest.model_dump(), "key": ""} == {
            **in_process.manifest.model_dump(),
            "key": "",
        }
        again = prepare(s3.uri("data"), cache)
        assert again.reused and again.manifest.to_json() == on_ray.manifest.to_json()
