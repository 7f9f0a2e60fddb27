"""A workload's collate and its counted metrics, piece by piece: the loaders and the
driver's monitor check batch with ``DataSplits.collate``; ``StepOutput.counts`` sum over
batches, resume from a checkpoint written by any number of workers, and are refused with
one clear sentence when they cannot make sense."""

from __future__ import annotations

from dataclasses import replace

import pytest
import sequences
import torch
from environments import make_env
from loop_harness import LocalSession, run_loop, worker_task

from raytrain_app.checkpoint.ranking import UnknownMonitorError, check_monitor_on_one_batch
from raytrain_app.checkpoint.train_state import merged_epoch_progress
from raytrain_app.config import config_from_dict
from raytrain_app.errors import BadInputError
from raytrain_app.planning.rules import make_plan
from raytrain_app.protocol import ModelSpec, StepOutput, check_counts_hook, counted_metrics
from raytrain_app.worker.global_metrics import Counts, EpochProgress
from raytrain_app.worker.loaders import build_worker_loaders

CPU = torch.device("cpu")


def _splits():
    return sequences.build_data({"num_samples": 60, "min_length": 2, "max_length": 9}, seed=0)


def test_the_loaders_batch_variable_length_sequences_with_the_workloads_collate():
    splits = _splits()
    cfg = config_from_dict({"experiment": {"seed": 0}, "train": {"global_batch_size": 8}})
    plan = replace(make_plan(cfg, make_env()), dataloader_workers=0, memory_probe=False)
    loaders = build_worker_loaders(
        splits.train,
        splits.val,
        plan,
        cfg.dataloader,
        seed=0,
        rank=0,
        world_size=1,
        prepare=lambda loader: loader,
        collate=splits.batch_collate(),
    )
    for batches in (loaders.epoch_batches(0), loaders.val):
        for (tokens, lengths), labels in batches:
            assert tokens.shape == (len(labels), int(lengths.max()))  # padded to the longest
            assert bool((tokens[torch.arange(len(labels)), lengths - 1] != 0).all())
    # Without a collate, the data's default is raytrain's (a CollatedBatch passes through).
    assert replace(splits, collate=None).batch_collate().__name__ == "collate"


def test_the_drivers_monitor_check_batches_with_the_collate_and_knows_counted_metrics():
    splits = _splits()
    spec = sequences.build_model({}, splits.info)
    for monitor in ("val_f1", "train_recall", "val_accuracy"):
        check_monitor_on_one_batch(monitor, spec, splits.val, splits.collate)
    with pytest.raises(UnknownMonitorError, match="val_f1"):
        check_monitor_on_one_batch("val_f2", spec, splits.val, splits.collate)


def test_counts_sum_over_batches_and_resume_from_any_number_of_workers():
    counts = Counts(CPU)
    counts.add({"confusion": torch.tensor([[3, 1], [0, 2]])})
    counts.add({"confusion": torch.tensor([[1, 0], [2, 5]])})
    totals = counts.global_totals(world_size=1)
    assert totals["confusion"].dtype == torch.float64
    assert totals["confusion"].tolist() == [[4.0, 1.0], [2.0, 7.0]]

    # A mid-epoch checkpoint keeps each rank's counts; another world size sums them on rank 0.
    saved = [EpochProgress(CPU) for _ in range(2)]
    saved[0].counts.add({"confusion": torch.tensor([[1, 2], [3, 4]])})
    saved[1].counts.add({"confusion": torch.tensor([[10, 20], [30, 40]])})
    merged = merged_epoch_progress([p.to_dict() for p in saved], rank=0)
    resumed = EpochProgress(CPU, merged)
    assert resumed.counts.global_totals(1)["confusion"].tolist() == [[11, 22], [33, 44]]
    assert (
        EpochProgress(CPU, merged_epoch_progress([p.to_dict() for p in saved], 1)).counts.sums == {}
    )


def test_counts_that_cannot_be_summed_are_refused_naming_the_key():
    counts = Counts(CPU)
    counts.add({"hist": torch.zeros(3)})
    with pytest.raises(BadInputError, match=r"counts\['hist'\] has shape \(3,\) and \(4,\)"):
        counts.add({"hist": torch.zeros(4)})
    with pytest.raises(BadInputError, match="same keys for every batch"):
        counts.add({"hist": torch.zeros(3), "other": torch.zeros(1)})


def _spec(metrics_from_counts=None) -> ModelSpec:
    def step(module, batch) -> StepOutput:
        return StepOutput(loss=torch.tensor(0.0), num_samples=1)

    return ModelSpec(
        module=torch.nn.Linear(1, 1), step=step, metrics_from_counts=metrics_from_counts
    )


def test_counts_without_a_hook_and_clashing_or_non_scalar_names_are_refused():
    with pytest.raises(BadInputError, match="ModelSpec has no metrics_from_counts"):
        check_counts_hook(_spec(), {"tp": torch.tensor(1)})
    check_counts_hook(_spec(), {})  # no counts, no hook: nothing to check
    totals = {"tp": torch.tensor(1.0)}
    with pytest.raises(BadInputError, match="returns 'mae', a name StepOutput metrics"):
        counted_metrics(_spec(lambda t: {"mae": 1.0}), totals, ["mae"])
    with pytest.raises(BadInputError, match="returns 'loss'"):
        counted_metrics(_spec(lambda t: {"loss": 1.0}), totals, [])
    with pytest.raises(BadInputError, match=r"shape \(2,\); return one number per name"):
        counted_metrics(_spec(lambda t: {"f1": torch.zeros(2)}), totals, [])
    assert counted_metrics(_spec(lambda t: {"tp": t["tp"]}), totals, []) == {"tp": 1.0}


def build_model_with_a_hook_but_no_counts(params: dict, data_info: dict) -> ModelSpec:
    spec = sequences.build_model(params, data_info)

    def step(module, batch) -> StepOutput:
        return replace(spec.step(module, batch), counts={})

    return replace(spec, step=step)


def test_a_counts_hook_whose_step_returns_no_counts_is_refused_after_the_first_epoch(tmp_path):
    raw = {
        "experiment": {"name": "seq", "output_dir": str(tmp_path), "seed": 0},
        "model": {"target": f"{__name__}:build_model_with_a_hook_but_no_counts"},
        "data": {"target": "sequences:build_data", "params": {"num_samples": 40}},
        "train": {"epochs": 2, "global_batch_size": 16},
        "scaling": {"num_workers": 1},
        "dataloader": {"num_workers": 0},
    }
    task = worker_task(config_from_dict(raw), tmp_path / "seq")
    with pytest.raises(BadInputError, match="has metrics_from_counts but no step returned"):
        run_loop(task, LocalSession(tmp_path / "c"))
