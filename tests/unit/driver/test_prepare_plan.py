"""``raytrain plan`` says which path the prepare pass of streaming data takes (each series
from its own row groups, or a shuffle) and what it holds, from the files' footers alone."""

from __future__ import annotations

from environments import make_env
from stream_data import LENGTHS, PARAMS, series_table, write_files, write_series_files

from raytrain_app.config import config_from_dict
from raytrain_app.data.stream_budget import SHUFFLE_COPIES
from raytrain_app.data.stream_prepare import prepare_stream
from raytrain_app.driver.data_plan import data_plan, data_plan_line
from raytrain_app.planning.rules import make_plan

# The columns the pass reads (wind, temp, power, turbine, hour) and its two position columns.
ROW_BYTES = (5 + 2) * 8


def described(tmp_path, source) -> dict:
    cfg = config_from_dict(
        {
            "experiment": {"name": "plan", "output_dir": str(tmp_path / "runs")},
            "data": {
                "path": str(source),
                "streaming": True,
                "cache_dir": str(tmp_path / "cache"),
                "params": PARAMS,
            },
            "train": {"global_batch_size": 2},
            "scaling": {"num_workers": 1},
        }
    )
    return data_plan(cfg, make_plan(cfg, make_env()))


def test_a_file_per_series_is_planned_as_the_direct_path_with_its_largest_series(tmp_path):
    source = write_series_files(tmp_path / "src", series_table())
    found = described(tmp_path, source)
    assert found["prepare"] == {
        "path": "direct",
        "data_bytes": sum(LENGTHS.values()) * ROW_BYTES,
        "task_bytes": max(LENGTHS.values()) * ROW_BYTES,  # one series a task
        "object_store_bytes": 0,
        "tasks": len(LENGTHS),
    }
    assert "prepare pass: direct, 4 task(s)" in "\n".join(data_plan_line(found))


def test_interleaved_series_are_planned_as_a_shuffle_with_its_object_store_budget(tmp_path):
    source = write_files(tmp_path / "src", series_table())
    found = described(tmp_path, source)
    total = sum(LENGTHS.values()) * ROW_BYTES
    assert found["prepare"] == {
        "path": "shuffle",
        "data_bytes": total,
        "task_bytes": total,  # far below Ray Data's block size: one block
        "object_store_bytes": SHUFFLE_COPIES * total,
        "tasks": 1,
    }
    line = "\n".join(data_plan_line(found))
    assert "prepare pass: shuffle (series interleaved in the files)" in line
    assert "spilled to disk beyond it" in line
    assert "(a task holding up to 0.1 MiB, one a CPU)" in line  # four blocks of 32 KB
    # once prepared, nothing is left to run: the plan shows the store instead
    prepare_stream(str(source), PARAMS, tmp_path / "cache")
    assert "prepare" not in described(tmp_path, source)


def test_a_shuffle_reads_small_row_groups_in_blocks_of_ray_datas_target_size(tmp_path, monkeypatch):
    """Not a block per row group: the pull-based sort's driver keeps a reference per pair of
    input and output blocks, and the pieces under 100 KB it moves. Measured on 32 series in
    320 row groups of 20k rows: the driver's PSS reached 856 MiB with a block per row group
    (359 MiB on a quarter of the data), 273 MiB in blocks (321 MiB on the quarter)."""
    from raytrain_app.data import stream_prepare

    source = write_files(tmp_path / "src", series_table())  # row groups of 100 rows
    monkeypatch.setattr(stream_prepare, "block_bytes", lambda: 250 * ROW_BYTES)
    found = described(tmp_path, source)["prepare"]
    assert found["path"] == "shuffle" and found["tasks"] == 3  # 590 rows, not 6 row groups
