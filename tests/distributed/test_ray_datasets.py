"""A data factory returning Ray Datasets (examples/ray_regression.py, Ray's own regression
example) trains through raytrain: the global batch per step and the steps per epoch are the
same on 1 and 2 workers, validation counts every row once, and a mid-epoch resume trains
only the epoch's remaining steps."""

from __future__ import annotations

import pytest
from paths import EXAMPLES

import raytrain_app as rt
from raytrain_app.driver import ray_datasets

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 64
NUM_ROWS = 1024
# Ray's train_test_split(0.3) cuts at int(0.7 * rows): 716 train rows (11 steps of 64, 12
# rows left over), 308 validation rows (5 batches of 64: 3 on rank 0, 2 on rank 1).
VAL_ROWS = NUM_ROWS - int(0.7 * NUM_ROWS)
STEPS = (NUM_ROWS - VAL_ROWS) // GLOBAL_BATCH


def _config(tmp_path, name: str, workers: int, *overrides: str) -> rt.RaytrainConfig:
    return rt.load_config(
        EXAMPLES / "ray_regression.yaml",
        [
            f"experiment.output_dir={tmp_path}",
            f"experiment.name={name}",
            f"data.params.csv={tmp_path / 'regression.csv'}",
            f"data.params.num_rows={NUM_ROWS}",
            "model.target=ray_data_counting:build_model",
            f"train.global_batch_size={GLOBAL_BATCH}",
            f"scaling.num_workers={workers}",
            "dataloader.num_workers=0",
            *overrides,
        ],
    )


def test_two_workers_train_one_global_batch_a_step_and_a_mid_epoch_failure_resumes_exactly(
    ray_cluster, tmp_path
):
    """Two workers, where Ray's split of the rows matters (one worker reads them all). One
    worker fails at step 8 of the first epoch and the run resumes from step 5's checkpoint:
    the epoch then trains only its remaining steps. (One run for both: a Ray run costs the
    suite some 20 s before its first step.)"""
    marker = tmp_path / "failed-once"
    cfg = _config(
        tmp_path,
        "w2",
        2,
        "train.epochs=3",
        "train.checkpoint_every_steps=5",
        "fault_tolerance.max_failures=1",
        "model.params.fail_at=8",  # after the checkpoint of step 5: resumes from there
        f"model.params.marker={marker}",
    )
    rows = rt.train(cfg, progress=False).metrics
    assert marker.exists()  # it did fail and resume
    assert rows[-1]["val_loss"] < 0.7 * rows[0]["val_loss"]
    # Every step takes one global batch, from as many rows on each worker; in the first
    # epoch, steps 1-5 before the failure and 6 to its end after it: no step twice, none
    # missing.
    assert [row["step"] for row in rows] == [STEPS, 2 * STEPS, 3 * STEPS]
    assert {row["train_rows"] for row in rows} == {STEPS * GLOBAL_BATCH}
    # Every validation row counted once, whatever the number of workers.
    assert {row["val_rows"] for row in rows} == {VAL_ROWS}


def test_fewer_rows_than_one_global_batch_are_refused_in_one_line(ray_cluster):
    from raytrain_app.workloads import FactoryRef

    ref = FactoryRef("ray_data_factories:tiny", {"rows": 63}, "data.target")
    with pytest.raises(rt.BadInputError) as info:
        ray_datasets.load_data_splits(ref, seed=0, global_batch_size=GLOBAL_BATCH)
    message = str(info.value)
    assert "\n" not in message and "data.target='ray_data_factories:tiny'" in message
    assert f"train.global_batch_size={GLOBAL_BATCH}" in message and "63 training rows" in message
