"""metrics.csv: one row per epoch, one header, and exact truncation when a run resumes."""

from __future__ import annotations

import csv

import pytest

from raytrain_app.tracking.metrics_log import BASE_COLUMNS, METRICS_FILE, MetricsLog, read_metrics


def row(epoch: int, **extra: float) -> dict[str, float]:
    return {
        "epoch": epoch,
        "step": 10 * epoch,
        "train_loss": 1.0 / epoch,
        "val_loss": 2.0 / epoch,
        "lr": 1e-3,
        "samples_per_s": 100.5,
        "epoch_time_s": 1.25,
        **extra,
    }


def write_epochs(run_dir, epochs: int) -> None:
    log = MetricsLog(run_dir, resumed_epoch=0)
    for epoch in range(1, epochs + 1):
        log.append(row(epoch, val_mae=0.5 / epoch, train_mae=0.25 / epoch))


def lines(run_dir) -> list[str]:
    return (run_dir / METRICS_FILE).read_text().splitlines()


def test_header_is_written_once_with_extra_metrics_after_the_base_columns(tmp_path):
    write_epochs(tmp_path, 3)
    text = lines(tmp_path)
    assert len(text) == 4
    assert text[0].split(",") == [*BASE_COLUMNS, "train_mae", "val_mae"]
    assert sum(line.startswith("epoch,") for line in text) == 1


def test_read_metrics_types(tmp_path):
    write_epochs(tmp_path, 2)
    rows = read_metrics(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(type(r["epoch"]) is int and type(r["step"]) is int for r in rows)
    assert all(type(r["train_loss"]) is float and type(r["val_mae"]) is float for r in rows)
    assert rows[1] == pytest.approx(row(2, val_mae=0.25, train_mae=0.125))


def test_read_metrics_of_a_run_without_metrics_is_empty(tmp_path):
    assert read_metrics(tmp_path) == []


def test_fresh_log_in_a_new_directory_starts_empty(tmp_path):
    MetricsLog(tmp_path, resumed_epoch=0)
    assert read_metrics(tmp_path) == []
    MetricsLog(tmp_path, resumed_epoch=0).append(row(1))
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1]


@pytest.mark.parametrize("resumed_epoch", [0, 1, 2, 4])
def test_resume_keeps_exactly_the_restored_epochs(tmp_path, resumed_epoch):
    write_epochs(tmp_path, 4)
    before = read_metrics(tmp_path)
    MetricsLog(tmp_path, resumed_epoch=resumed_epoch)
    assert read_metrics(tmp_path) == before[:resumed_epoch]


def test_resumed_log_appends_under_the_same_header(tmp_path):
    write_epochs(tmp_path, 4)  # epochs 3 and 4 ran after the last checkpoint, then a crash
    log = MetricsLog(tmp_path, resumed_epoch=2)
    log.append(row(3, val_mae=9.0, train_mae=8.0))
    text = lines(tmp_path)
    assert text[0].split(",") == [*BASE_COLUMNS, "train_mae", "val_mae"]
    assert sum(line.startswith("epoch,") for line in text) == 1
    rows = read_metrics(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert rows[2]["val_mae"] == 9.0 and rows[2]["train_mae"] == 8.0


def test_file_stays_valid_csv(tmp_path):
    write_epochs(tmp_path, 2)
    MetricsLog(tmp_path, resumed_epoch=1).append(row(2, val_mae=1.0, train_mae=1.0))
    with (tmp_path / METRICS_FILE).open(newline="") as handle:
        parsed = list(csv.reader(handle))
    assert {len(r) for r in parsed} == {len(BASE_COLUMNS) + 2}
    assert not list(tmp_path.glob("*.tmp"))  # the atomic rewrite left nothing behind


def test_resume_keeps_columns_when_an_early_metric_cell_is_empty(tmp_path):
    log = MetricsLog(tmp_path, resumed_epoch=0)
    base = {
        "step": 1,
        "train_loss": 1.0,
        "val_loss": 1.0,
        "lr": 0.1,
        "samples_per_s": 1.0,
        "epoch_time_s": 1.0,
    }
    log.append({"epoch": 1, **base, "val_mae": ""})
    log.append({"epoch": 2, **base, "val_mae": 0.5})
    resumed = MetricsLog(tmp_path, resumed_epoch=2)
    resumed.append({"epoch": 3, **base, "val_mae": 0.4})
    assert [row["epoch"] for row in read_metrics(tmp_path)] == [1, 2, 3]
