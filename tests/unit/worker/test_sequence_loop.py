"""The variable-length sequence example (``examples/sequences.py``) in the worker loop, on
one worker and on two gloo ranks (no Ray): its F1 is made of confusion counts summed over
every worker, so ``val_f1`` is the F1 of the whole validation set, the same for 1 and 2
workers, with an odd number of validation samples split unevenly between the ranks;
``train_f1`` survives a mid-epoch resume exactly; ``raytrain predict`` pads with the
workload's collate."""

from __future__ import annotations

import functools
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sequences
import torch
from gloo_ranks import run_on_two_ranks
from loop_harness import Crash, LocalSession, assert_same_run, run_loop, worker_task
from torch.utils.data import DataLoader

from raytrain_app.config import config_from_dict
from raytrain_app.errors import BadInputError
from raytrain_app.predict import predict
from raytrain_app.worker.global_metrics import Counts
from raytrain_app.worker.loop import WorkerLoop, WorkerTask

# 252 train samples (7 steps of 32 per epoch), 109 validation samples: 55 + 54 on 2 ranks.
DATA = {"num_samples": 361, "train_fraction": 0.7}


def _task(root: Path, world_size: int, **train: object) -> WorkerTask:
    raw = {
        "experiment": {"name": "seq", "output_dir": str(root / "runs"), "seed": 2},
        "model": {"target": "sequences:build_model", "params": {"hidden": 8}},
        "data": {"target": "sequences:build_data", "params": DATA},
        "train": {"epochs": 3, "global_batch_size": 32, "lr": 0.03, **train},
        "scaling": {"num_workers": world_size},
        "distributed": {"backend": "gloo"},
        "dataloader": {"num_workers": 0},
    }
    return worker_task(config_from_dict(raw), root / "runs" / "seq")


def _two_rank_run(rank: int, task: WorkerTask, storage: str) -> dict:
    torch.set_num_threads(1)
    loop = WorkerLoop(task, LocalSession(Path(storage)))
    result = loop.run()
    # Counts alone: a rank without any (no validation batch) joins with zeros; a count whose
    # shape differs between the ranks is refused on both, before any all-reduce.
    only_rank0 = Counts(torch.device("cpu"))
    if rank == 0:
        only_rank0.add({"confusion": torch.tensor([[1, 2], [3, 4]])})
    uneven = Counts(torch.device("cpu"))
    uneven.add({"hist": torch.zeros(3 + rank)})
    try:
        uneven.global_totals(2)
        refused = ""
    except BadInputError as exc:
        refused = str(exc)
    return {
        "history": result["history"],
        "weights": loop.module.state_dict(),
        "totals": only_rank0.global_totals(2)["confusion"].tolist(),
        "refused": refused,
    }


def _f1_of_whole_validation_set(weights: dict[str, torch.Tensor]) -> float:
    """F1 of ``weights`` over every validation sample, in one pass, without raytrain."""
    splits = sequences.build_data(DATA, seed=2)
    spec = sequences.build_model({"hidden": 8}, splits.info)
    spec.module.load_state_dict(weights)
    spec.module.eval()
    confusion = torch.zeros(2, 2, dtype=torch.float64)
    with torch.no_grad():
        for batch in DataLoader(splits.val, batch_size=len(splits.val), collate_fn=splits.collate):
            confusion += spec.step(spec.module, batch).counts["confusion"]
    return sequences.f1_from_counts({"confusion": confusion})["f1"]


def test_val_f1_is_the_whole_validation_sets_on_one_and_two_workers(tmp_path):
    one, weights = run_loop(_task(tmp_path / "one", 1), LocalSession(tmp_path / "one" / "c"))
    work = functools.partial(
        _two_rank_run, task=_task(tmp_path / "two", 2), storage=str(tmp_path / "two" / "c")
    )
    two = run_on_two_ranks(work, tmp_path)

    last = one["history"][-1]
    assert {"train_f1", "val_f1", "val_precision", "val_recall", "val_accuracy"} <= last.keys()
    assert 0.0 < last["val_f1"] < 1.0  # not a trivial F1: the test could tell them apart
    assert last["val_f1"] == _f1_of_whole_validation_set(weights)
    for rank in two:
        assert rank["totals"] == [[1, 2], [3, 4]]
        assert "counts['hist'] has shape (3,) and (4,) in different workers" in rank["refused"]
    for rank in two:  # every rank reports the same global values
        assert rank["history"][-1]["val_f1"] == _f1_of_whole_validation_set(rank["weights"])
        for row_one, row_two in zip(one["history"], rank["history"], strict=True):
            for key in ("train_f1", "val_f1", "val_precision", "val_recall"):
                assert row_two[key] == row_one[key], key
            assert row_two["val_loss"] == pytest.approx(row_one["val_loss"], rel=1e-4)


def test_train_f1_resumes_mid_epoch_exactly_and_predict_pads_with_the_collate(tmp_path):
    every = {"checkpoint_every_steps": 3}  # 7 steps per epoch: checkpoints at 3, 6, 7, 10
    reference = run_loop(_task(tmp_path / "a", 1, **every), LocalSession(tmp_path / "a" / "c"))
    task, storage = _task(tmp_path / "b", 1, **every), tmp_path / "b" / "c"
    with pytest.raises(Crash):  # 3 steps into epoch 2, with that epoch's counts saved
        run_loop(task, LocalSession(storage, crash_after_checkpoints=4))
    assert_same_run(run_loop(task, LocalSession(storage)), reference)

    newest = LocalSession(storage).checkpoints()[0]
    table = pq.read_table(
        predict(newest, output_path=tmp_path / "pred.parquet", trust_code=True)
    ).to_pydict()
    assert len(table["pred_0"]) == 109
    predicted = torch.tensor(table["pred_0"]).long()
    actual = torch.tensor(table["true_0"]).long()
    confusion = torch.bincount(2 * actual + predicted, minlength=4).view(2, 2).double()
    f1 = sequences.f1_from_counts({"confusion": confusion})["f1"]
    assert f1 == reference[0]["history"][-1]["val_f1"]
