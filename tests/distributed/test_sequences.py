"""The variable-length sequence example (examples/sequences.py) on Ray with 2 workers: its
padding collate, F1 from summed counts in metrics.csv, and the best checkpoint by val_f1."""

from __future__ import annotations

import csv

import pytest
from paths import EXAMPLES

import raytrain_app as rt

pytestmark = pytest.mark.distributed


def test_the_sequence_example_reports_f1_and_ranks_checkpoints_by_it(ray_cluster, tmp_path):
    overrides = [
        f"experiment.output_dir={tmp_path}",
        "train.epochs=2",
        "data.params.num_samples=512",
        "dataloader.num_workers=0",
    ]
    cfg = rt.load_config(EXAMPLES / "sequences.yaml", overrides)
    result = rt.train(cfg, progress=False)
    with open(tmp_path / "sequences" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert (
        len(rows) == 2 and {"train_f1", "val_f1", "val_precision", "val_recall"} <= rows[0].keys()
    )
    best = result.summary["best_metric"]
    assert best["metric"] == "val_f1" and best["mode"] == "max"
    assert best["value"] == max(float(row["val_f1"]) for row in rows)
