"""`raytrain train` end to end on a real Ray (CPU, gloo): what a user relies on."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from ray_sessions import MetricsScrape
from torch import nn

import raytrain_app as rt
from raytrain_app.checkpoint.store import MODEL_FILE, read_meta
from raytrain_app.driver.goodput import GOODPUT_PARTS
from raytrain_app.errors import BadInputError
from raytrain_app.models.wind_transformer import WindTransformer
from raytrain_app.tracking.metrics_log import GOODPUT_COLUMNS
from raytrain_app.worker import live_metrics
from raytrain_app.workloads import FactoryRef, build_data

pytestmark = pytest.mark.distributed

EPOCHS = 3


def small_config(output_dir: Path, name: str, workers: int, **train) -> dict:
    """A run that keeps the quickstart's shape but finishes in seconds."""
    return {
        "experiment": {"name": name, "output_dir": str(output_dir), "seed": 0},
        "data": {"params": {"num_turbines": 4, "num_hours": 2400, "stride": 2}},
        # Dropout masks are drawn per rank by design, so they differ between 1 and 2 workers;
        # without dropout the two runs differ only in floating-point reduction order.
        "model": {"params": {"dropout": 0.0}},
        "train": {"epochs": EPOCHS, "global_batch_size": 64, **train},
        "scaling": {"num_workers": workers},
        "fault_tolerance": {"max_failures": 0},
    }


class _RunsByWorkers(dict):
    """Runs of the same config and seed by number of workers, each trained when first
    asked for (the compatibility tier asks for the 2-worker run alone)."""

    def __init__(self, out: Path):
        super().__init__()
        self.out = out

    def __missing__(self, workers: int):
        before = _actor_ids()
        # What Ray's Prometheus endpoint showed while the run trained.
        with MetricsScrape() as scrape:
            cfg = small_config(self.out, f"w{workers}", workers)
            self[workers] = rt.train(cfg, progress=False)
        self.scraped = {**getattr(self, "scraped", {}), workers: scrape.samples}
        # What this run started (the session's Ray also serves other modules' runs, some
        # with Ray Datasets, which do need Ray Train's dataset actors).
        self.started_actors = getattr(self, "started_actors", set()) | {
            name for actor_id, name in _actor_ids().items() if actor_id not in before
        }
        return self[workers]


def _actor_ids() -> dict[str, str]:
    """Every actor of this session's Ray: id -> class name."""
    import ray
    from ray.util.state import list_actors

    # This session's Ray by address: another Ray on the machine (a parallel test run, the
    # cluster tier's head) would make an address-less query refuse to pick one.
    address = ray.get_runtime_context().gcs_address
    return {a.actor_id: a.class_name for a in list_actors(address=address, limit=1000)}


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory) -> _RunsByWorkers:
    """A 1-worker and a 2-worker run of the same config and seed."""
    return _RunsByWorkers(tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.compat)])
def test_loss_falls_and_the_forecast_beats_persistence(runs, workers):
    metrics = runs[workers].metrics
    assert [row["epoch"] for row in metrics] == list(range(1, EPOCHS + 1))
    assert metrics[-1]["val_loss"] < 0.9 * metrics[0]["val_loss"]
    assert metrics[-1]["train_loss"] < 0.8 * metrics[0]["train_loss"]
    # Skill: clearly better than repeating the last value, on the same validation windows.
    assert metrics[-1]["val_mae"] < 0.8 * metrics[-1]["val_persistence_mae"]


@pytest.mark.parametrize("workers", [1, 2])
def test_run_directory_is_complete(runs, workers):
    result = runs[workers]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    for key in (
        "final_metrics",
        "world_size",
        "per_worker_batch_size",
        "grad_accum_steps",
        "effective_batch_size",
        "precision",
        "backend",
        "wall_time_s",
        "samples_per_s",
        "checkpoint",
        "worker_nodes",
    ):
        assert key in summary, key
    assert summary["world_size"] == workers
    assert summary["effective_batch_size"] == 64
    assert summary["per_worker_batch_size"] * workers * summary["grad_accum_steps"] == 64
    assert (summary["precision"], summary["backend"]) == ("fp32", "gloo")
    assert summary["samples_per_s"] > 0 and len(summary["worker_nodes"]) == 1
    assert (Path(summary["checkpoint"]) / MODEL_FILE).is_file()
    with (result.run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == EPOCHS
    for column in (
        "epoch",
        "step",
        "train_loss",
        "val_loss",
        "lr",
        "samples_per_s",
        "epoch_time_s",
        "val_mae",
    ):
        assert all(row[column] != "" for row in rows), column
    # The resolved config is re-runnable as is: it loads and has no "auto" left.
    resolved = rt.load_config(result.run_dir / "config.yaml")
    assert resolved.scaling.num_workers == workers and resolved.precision == "fp32"


def test_the_goodput_parts_sum_to_the_wall_time(runs):
    result = runs[2]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    goodput = summary["goodput"]
    assert set(goodput) == set(GOODPUT_PARTS)
    assert sum(goodput.values()) == pytest.approx(summary["wall_time_s"], rel=0.02)
    for part in ("startup_s", "compute_s", "data_wait_s", "checkpoint_s", "validation_s"):
        assert goodput[part] > 0, part
    assert goodput["restart_s"] == goodput["lost_work_s"] == 0  # nothing failed
    # Every epoch's own seconds, in metrics.csv; its steps' compute and data waits fit in
    # the epoch's training time, measured apart from them.
    for row in result.metrics:
        assert all(row[column] >= 0 for column in GOODPUT_COLUMNS), row
        assert row["time_compute_s"] + row["time_data_wait_s"] <= row["epoch_time_s"] * 1.02


def test_rays_metrics_endpoint_shows_each_workers_live_numbers_while_it_trains(runs):
    runs[2]
    seen = {(name, labels.get("run"), labels.get("rank")) for name, labels, _ in runs.scraped[2]}
    for metric in (live_metrics.STEP_TIME, live_metrics.SAMPLES_PER_S, live_metrics.DATA_WAIT):
        ranks = {rank for name, run, rank in seen if (name, run) == (f"ray_{metric}", "w2")}
        assert ranks == {"0", "1"}, (metric, seen)  # every worker, tagged with its run
    # Ray's exporter names a Counter ..._total; an epoch's checkpoint blocks rank 0.
    blocked = f"ray_{live_metrics.CHECKPOINT_BLOCKED}_total"
    assert (blocked, "w2", "0") in seen, seen
    # No FLOP count and no peak rate for a CPU: no MFU (worker.throughput).
    assert not [entry for entry in seen if entry[0] == f"ray_{live_metrics.MFU}"]


def test_one_and_two_workers_train_the_same_optimisation(runs):
    one, two = runs[1].metrics[-1], runs[2].metrics[-1]
    assert two["step"] == one["step"]  # same optimizer steps: the global batch is the user's
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=0.02)
    # Same samples in every global step, same initial weights: in practice far closer.
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-3)


def test_only_rank_zero_wrote_files(runs):
    root = runs[2].run_dir
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert not [f for f in files if f.endswith(".tmp")], files
    top_level = {f for f in files if "/" not in f}
    assert top_level == {"config.yaml", "metrics.csv", "summary.json", "loss.png"}
    # TensorBoard (on by default): one event file, rank 0's
    assert len([f for f in files if f.startswith("tensorboard/events.out.tfevents.")]) == 1
    checkpoints = sorted({Path(f).parent for f in files if f.endswith(MODEL_FILE)})
    assert len(checkpoints) == 2  # train.keep_checkpoints default
    for directory in checkpoints:
        names = sorted(p.name for p in (root / directory).iterdir())
        assert names == ["manifest.json", "meta.json", "model.pt", "train_state.pt"], names
    # checkpoints are copied under a temporary name and renamed: none is left half-copied
    assert not [f for f in files if ".partial/" in f], files
    epochs = [row["epoch"] for row in runs[2].metrics]
    assert epochs == sorted(set(epochs))  # one row per epoch, not one per rank


def test_checkpoint_loads_into_a_plain_module_on_cpu(runs):
    model = rt.load_model(runs[2].checkpoint)
    assert type(model) is WindTransformer and not model.training
    assert all(p.device.type == "cpu" for p in model.parameters())
    state = torch.load(runs[2].checkpoint / MODEL_FILE, weights_only=True)
    assert not [k for k in state if k.startswith(("module.", "_orig_mod."))]
    args = _constructor_args(runs[2].checkpoint)
    plain = WindTransformer(**args)
    plain.load_state_dict(state)  # a bare nn.Module, no raytrain needed
    x = torch.randn(3, args["context_length"], args["num_features"])
    assert torch.allclose(plain.eval()(x), model(x))


def _constructor_args(checkpoint: Path) -> dict:
    info = read_meta(checkpoint)["data_info"]
    return {
        "num_features": info["num_features"],
        "context_length": info["context_length"],
        "horizon": info["horizon"],
    }


def test_validation_loss_is_the_exact_global_mean(runs):
    """Recompute val_loss on one CPU over the whole validation set: every sample once."""
    meta = read_meta(runs[2].checkpoint)
    splits = build_data(FactoryRef(**meta["data_factory"]), 0)
    model = rt.load_model(runs[2].checkpoint)
    with torch.no_grad():
        xs, ys = zip(*(splits.val[i] for i in range(len(splits.val))), strict=True)
        loss = nn.functional.mse_loss(model(torch.stack(xs)), torch.stack(ys)).item()
    assert runs[2].metrics[-1]["val_loss"] == pytest.approx(loss, rel=1e-4)


def test_plan_is_still_callable_after_train(runs, tmp_path):
    """A notebook plans again after training: ``rt.plan`` must still be the function."""
    cfg = small_config(tmp_path, "again", 2)
    assert rt.plan(cfg) == rt.plan(cfg)
    assert rt.plan(cfg).world_size == 2


def test_a_different_config_under_an_existing_name_is_refused(runs):
    root = runs[2].run_dir
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    cfg = small_config(root.parent, root.name, 2, lr=3e-3)
    with pytest.raises(BadInputError, match=r"experiment.name 'w2' already holds a run.*train.lr"):
        rt.train(cfg, progress=False)
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert after == before


def test_predict_writes_parquet_from_a_run_directory(runs, tmp_path):
    import pyarrow.parquet as pq

    from raytrain_app.cli import main

    output = tmp_path / "predictions.parquet"
    assert main(["predict", "--checkpoint", str(runs[2].run_dir), "--output", str(output)]) == 0
    table = pq.read_table(output)
    meta = read_meta(runs[2].checkpoint)
    horizon = meta["data_info"]["horizon"]
    splits = build_data(FactoryRef(**meta["data_factory"]), 0)
    assert table.num_rows == len(splits.val)
    assert table.column_names == [f"pred_{k}" for k in range(horizon)] + [
        f"true_{k}" for k in range(horizon)
    ]
    pred, true = table.column("pred_0").to_numpy(), table.column("true_0").to_numpy()
    # Predictions are in the data's units (fraction of rated power) and track the truth.
    assert true.min() >= 0 and true.max() <= 1
    assert abs(pred - true).mean() < 0.25


def test_the_runs_started_only_the_ray_actors_training_needs(runs):
    # On a Ray this process started, without Ray Datasets, Ray Train's dataset manager,
    # autoscaling coordinator and placement-group cleaner would each be one more process
    # to start before the first step (raytrain_app/driver/trainer.py), and so would Ray
    # Train's controller, which runs in the driver (driver/controller_in_driver.py).
    runs[1], runs[2]  # both trained (once per module)
    started = runs.started_actors
    assert "RayTrainWorker" in started
    left_out = {"TrainController", "DatasetManager", "PlacementGroupCleaner"}
    assert not started & (left_out | {"_AutoscalingCoordinatorActor"})
