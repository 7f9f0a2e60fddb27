"""``metrics.csv`` of a run: one row per epoch, written by rank 0 only."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping
from pathlib import Path

METRICS_FILE = "metrics.csv"
BASE_COLUMNS = ("epoch", "step", "train_loss", "val_loss", "lr", "samples_per_s", "epoch_time_s")
# Each epoch's seconds by what they went to (worker.goodput), since the previous row.
GOODPUT_COLUMNS = (
    "time_data_wait_s",
    "time_compute_s",
    "time_checkpoint_s",
    "time_validation_s",
    "time_other_s",
)
# The columns measured in time (worker.throughput, worker.goodput): two runs of the same
# training differ in them and in nothing else, so a comparison of runs leaves them out.
TIMING_COLUMNS = (
    *("samples_per_s", "epoch_time_s", "items_per_s", "flops_per_s_per_worker", "mfu"),
    *GOODPUT_COLUMNS,
)


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The rows of ``metrics.csv`` as floats (ints for epoch and step); [] when absent."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return read_metrics_text(path.read_text())


def read_metrics_text(text: str) -> list[dict[str, float]]:
    """The rows of a ``metrics.csv`` given as text (read from the run's storage)."""
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    return [
        {k: (int(v) if k in ("epoch", "step") else float(v)) for k, v in row.items() if v != ""}
        for row in rows
    ]


class MetricsLog:
    """Appends epoch rows; on resume it first drops rows after the restored epoch."""

    def __init__(self, run_dir: Path, resumed_epoch: int) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        kept = [row for row in read_metrics(run_dir) if row["epoch"] <= resumed_epoch]
        self._columns: list[str] | None = self._header() if kept else None
        # Rewrite atomically so a crash here never leaves a half-written history.
        tmp = self.path.with_name(METRICS_FILE + ".tmp")
        with tmp.open("w", newline="") as handle:
            if kept:
                writer = csv.DictWriter(handle, fieldnames=self._columns)
                writer.writeheader()
                writer.writerows(kept)
        os.replace(tmp, self.path)

    def _header(self) -> list[str]:
        with self.path.open(newline="") as handle:
            return list(csv.DictReader(handle).fieldnames or [])

    def append(self, row: Mapping[str, float]) -> None:
        """Add one epoch's row; the first row fixes the columns."""
        if self._columns is None:
            extra = sorted(k for k in row if k not in BASE_COLUMNS)
            self._columns = [*BASE_COLUMNS, *extra]
            header = True
        else:
            header = False
        with self.path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self._columns, extrasaction="ignore")
            if header:
                writer.writeheader()
            writer.writerow(row)
