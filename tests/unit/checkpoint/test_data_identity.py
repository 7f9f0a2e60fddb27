"""A resume on other data is refused: every checkpoint of a ``data.path`` run records the
files it was trained on (and, streaming, the prepared store's key and manifest digest), and
the driver compares them with ``data.path`` before it prepares the data.

Before: a file added to or rewritten under ``data.path`` gave other windows (streaming:
another prepared store), and the resume applied the saved (epoch, step) to them, silently.
Each mode trains one real run in Ray Train's local mode (seconds), then edits its data.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from stream_data import PARAMS, series_table, stream_run_config, write_files

from raytrain_app.checkpoint.data_identity import (
    IDENTITY_KEY,
    FileRecord,
    ResumedData,
    file_changes,
)
from raytrain_app.checkpoint.ranking import metas_newest_first
from raytrain_app.config import config_from_dict
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.driver.training import train
from raytrain_app.errors import BadInputError
from raytrain_app.workloads import FactoryRef


@pytest.fixture(scope="module", params=[False, True], ids=["in_memory", "streaming"])
def trained(request, tmp_path_factory):
    """A finished one-epoch run on two Parquet files: its config and data folder."""
    root = tmp_path_factory.mktemp("run")
    folder = write_files(root / "data", series_table())
    cfg = stream_run_config(
        "identity", str(root / "runs"), str(folder), str(root / "cache"), PARAMS
    )
    cfg["data"]["streaming"] = request.param
    cfg = config_from_dict(cfg)
    saved = dict(os.environ)  # a run sets Ray Train's variables
    try:
        train(cfg, local=True, progress=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return cfg, folder


@pytest.fixture
def run(trained, tmp_path):
    """The trained run, whose data and checkpoints' meta.json a test may edit: restored
    afterwards (copies keep the files' mtimes, which the run recorded)."""
    cfg, folder = trained
    shutil.copytree(folder, tmp_path / "data")
    checkpoints = RunDirectory.for_config(cfg).at("checkpoints").local_path
    metas = {p: p.read_text() for p in checkpoints.glob("**/meta.json")}
    yield cfg, folder
    shutil.rmtree(folder)
    shutil.copytree(tmp_path / "data", folder)
    for path, text in metas.items():
        path.write_text(text)


def _checked(cfg, resuming: bool = True) -> ResumedData:
    run_dir = RunDirectory.for_config(cfg)
    return ResumedData.checked(cfg.data, run_dir.at("checkpoints"), run_dir.at("data"), resuming)


def _prepared(cfg) -> FactoryRef:
    """The data the run's workers loaded, as its newest checkpoint names it."""
    _, meta = next(metas_newest_first(RunDirectory.for_config(cfg).at("checkpoints")))
    return FactoryRef(**meta["data_factory"])


def _rewrite(file: Path) -> None:
    """``file`` written again with other values in its rows: data a run takes as well."""
    table = pq.read_table(file)
    wind = pc.multiply(table.column("wind"), 2.0)
    table = table.set_column(table.schema.get_field_index("wind"), "wind", wind)
    pq.write_table(table, file, row_group_size=100)


def _refusal(cfg) -> str:
    with pytest.raises(BadInputError) as refused:
        train(cfg, local=True, progress=False)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_every_checkpoint_records_the_files_it_was_trained_on(trained):
    cfg, _ = trained
    metas = [m for _, m in metas_newest_first(RunDirectory.for_config(cfg).at("checkpoints"))]
    assert metas
    for meta in metas:
        names = [f["name"] for f in meta[IDENTITY_KEY]["files"]]
        assert names == ["part-0.parquet", "part-1.parquet"]
        streaming = meta[IDENTITY_KEY]["store_key"] is not None
        assert streaming == cfg.data.streaming
        assert (meta[IDENTITY_KEY]["manifest_sha256"] is not None) == streaming


def test_a_rewritten_file_under_data_path_refuses_the_resume_in_one_line(run):
    cfg, data = run
    _rewrite(data / "part-1.parquet")
    message = _refusal(cfg)
    assert f"data.path '{data}'" in message
    assert "(files changed: part-1.parquet)" in message
    assert "restore those files as they were, or start a new run" in message


def test_added_and_removed_files_are_named(run):
    cfg, data = run
    (data / "part-0.parquet").rename(data / "part-2.parquet")
    message = _refusal(cfg)
    assert "(files added: part-2.parquet; removed: part-0.parquet)" in message


def test_the_same_data_resumes_and_records_what_the_checkpoint_holds(run):
    cfg, _ = run
    resumed = _checked(cfg)
    assert resumed.recorded is not None
    assert resumed.prepared(_prepared(cfg)) == resumed.recorded.model_dump()


def _record(cfg, key: str, value) -> None:
    """Every checkpoint of the run as if it had recorded ``value`` under ``key``."""
    for where, meta in metas_newest_first(RunDirectory.for_config(cfg).at("checkpoints")):
        meta[IDENTITY_KEY][key] = value
        (Path(where) / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("trained", [True], ids=["streaming"], indirect=True)
def test_the_same_files_in_a_store_prepared_otherwise_are_refused(run):
    """The key changes with raytrain's prepared format; the manifest when the store was
    prepared again."""
    cfg, _ = run
    _record(cfg, "manifest_sha256", "0" * 64)
    resumed = _checked(cfg)  # the files are the same
    with pytest.raises(BadInputError, match=r"prepared store's manifest \(.*\) differs"):
        resumed.prepared(_prepared(cfg))
    _record(cfg, "store_key", "0" * 64)
    with pytest.raises(BadInputError, match=r"the same files .* store's key differs"):
        _checked(cfg)


def test_a_checkpoint_without_a_record_resumes_as_before(run, caplog):
    cfg, data = run
    for where, meta in metas_newest_first(RunDirectory.for_config(cfg).at("checkpoints")):
        del meta[IDENTITY_KEY]
        (Path(where) / "meta.json").write_text(json.dumps(meta))
    _rewrite(data / "part-1.parquet")
    assert _checked(cfg).recorded is None
    assert "records no data identity" in caplog.text


def test_an_edited_record_is_refused_naming_its_file(run):
    cfg, _ = run
    newest, meta = next(metas_newest_first(RunDirectory.for_config(cfg).at("checkpoints")))
    meta[IDENTITY_KEY]["files"][0]["size"] = "12"
    (Path(newest) / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(BadInputError, match=r"meta.json' is not a raytrain checkpoint's"):
        _checked(cfg)


def test_a_refusal_names_a_few_files_of_each_kind_and_counts_the_rest():
    old = [FileRecord(name=f"{i}.parquet", size=1, mtime_ns=1) for i in range(6)]
    new = [FileRecord(name=f"{i}.parquet", size=2, mtime_ns=1) for i in range(5)]
    new += [FileRecord(name="x.parquet", size=1, mtime_ns=1)]
    assert file_changes(old, new) == (
        "added: x.parquet; removed: 5.parquet; changed: 0.parquet, 1.parquet, 2.parquet and 2 more"
    )
    assert file_changes(old, old) == ""
