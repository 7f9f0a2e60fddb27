"""What a rank of streaming data reads, and what ``raytrain plan`` says about it.

- A resume deep into an epoch reads the blocks holding its step (one per lane, and the next
  one ahead) and nothing before: the bytes read stay within the rank's read-ahead bound,
  a small part of the data, wherever in the epoch it resumes.
- ``raytrain plan`` shows lanes, where preprocessing runs, the Parquet's size, the
  read-ahead bound, and once prepared the windows and the steps per epoch.
"""

from __future__ import annotations

import numpy as np
import pytest
from environments import make_env
from stream_data import PARAMS, prepare_here, series_table, write_files

from raytrain_app.config import config_from_dict
from raytrain_app.data.stream_reader import PreparedFiles
from raytrain_app.driver.data_plan import data_plan, data_plan_line
from raytrain_app.planning.rules import make_plan
from raytrain_app.worker.stream_batches import StreamBatches, read_ahead_bytes

# Two long series: 2 lanes (global batch 2) of about 37 000 windows, 9 blocks each.
LENGTHS = {1: 60_000, 2: 40_000}
STREAM_PARAMS = {**PARAMS, "stride": 1}


def _config(tmp_path, source, **data) -> dict:
    return {
        "experiment": {"name": "plan", "output_dir": str(tmp_path / "runs")},
        "data": {
            "path": str(source),
            "streaming": True,
            "cache_dir": str(tmp_path / "cache"),
            "params": STREAM_PARAMS,
            **data,
        },
        "train": {"global_batch_size": 2},
        "scaling": {"num_workers": 1},
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    table = series_table(lengths=LENGTHS, gaps=False)
    return write_files(tmp_path_factory.mktemp("long"), table)


def test_a_resume_deep_into_an_epoch_reads_only_the_blocks_it_needs(source, tmp_path):
    prepared = prepare_here(str(source), STREAM_PARAMS, tmp_path / "cache")
    cfg = config_from_dict(_config(tmp_path, source))
    plan = make_plan(cfg, make_env())
    files = PreparedFiles(prepared.manifest, prepared.location)
    stream = StreamBatches(files, plan, seed=0, rank=0, world_size=1, prepare=lambda x: x)
    try:
        assert stream.lanes == 2 and stream.steps_per_epoch > 30_000
        manifest = prepared.manifest
        bound = read_ahead_bytes(manifest.rows_per_group, manifest.window, 3, lanes_per_rank=2)
        total = sum(entry.rows for entry in manifest.series) * manifest.num_columns * 4
        for step in (stream.steps_per_epoch // 2, stream.steps_per_epoch - 1):
            files.bytes_read = 0
            first = next(stream.epoch_batches(1, skip_samples=step * 2))
            stream.shut_down()  # let the read-ahead finish, so that it is counted
            stream._pool = type(stream._pool)(2)
            assert len(first[0]) == 2
            # The epoch so far would be half of the data or more; this is its blocks only.
            assert 0 < files.bytes_read <= bound, (step, files.bytes_read, bound)
            assert files.bytes_read < total / 2, (step, files.bytes_read, total)
    finally:
        stream.shut_down()


def test_the_plan_shows_lanes_sizes_and_once_prepared_the_steps(source, tmp_path):
    cfg = config_from_dict(_config(tmp_path, source, preprocess_resources={"data_prep": 1}))
    plan = make_plan(cfg, make_env())
    before = data_plan(cfg, plan)
    assert before["streaming"] and before["lanes"] == 2 and not before["prepared"]
    assert before["preprocess_on"] == {"data_prep": 1.0} and before["source_files"] == 2
    lines = "\n".join(data_plan_line(before))
    assert "streaming over 2 lanes, prepared on nodes offering {'data_prep': 1.0}" in lines
    assert "prepared when the run starts" in lines

    prepare_here(str(source), STREAM_PARAMS, tmp_path / "cache")
    after = data_plan(cfg, plan)
    windows = after["train_windows"]
    assert after["prepared"] and after["steps_per_epoch"] == windows // 2
    assert f"{windows:,} train" in "\n".join(data_plan_line(after))
    loaded = data_plan(
        config_from_dict(
            {
                **_config(tmp_path, source),
                "data": {"path": str(source), "streaming": False, "params": STREAM_PARAMS},
            }
        ),
        plan,
    )
    assert loaded == {"streaming": False}
    assert np.isclose(after["source_bytes"], before["source_bytes"])
