"""The built-in image workload on a real Ray (CPU, gloo): SyncBatchNorm, accuracy, checkpoints."""

from __future__ import annotations

import csv
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from torch import nn

import raytrain_app as rt
from raytrain_app.checkpoint.loading import find_checkpoint
from raytrain_app.checkpoint.store import MODEL_FILE, read_meta
from raytrain_app.cli import main
from raytrain_app.models.resnet_small import ResNetSmall
from raytrain_app.workloads import FactoryRef, build_data

pytestmark = pytest.mark.distributed

IMAGE_YAML = Path(rt.__file__).parent / "configs" / "image.yaml"
WIDTHS = [8, 16]


def image_config(output_dir: Path, name: str, workers: int, sync_batchnorm: bool) -> dict:
    """The shipped image.yaml, shrunk to seconds, its model saving every rank's BN buffers."""
    cfg = yaml.safe_load(IMAGE_YAML.read_text())
    probe = output_dir / f"{name}_probe"
    probe.mkdir(parents=True)
    cfg["experiment"] = {"name": name, "output_dir": str(output_dir), "seed": 0}
    cfg["model"] = {
        "target": "bn_probe:build_model",
        "params": {"widths": WIDTHS, "probe_dir": str(probe)},
    }
    # 201 validation images: the two ranks' shards differ in size (101 and 100).
    cfg["data"]["params"].update(num_train=768, num_val=201, image_size=16, pad=2)
    cfg["train"].update(epochs=2, global_batch_size=32)
    cfg["scaling"]["num_workers"] = workers
    cfg["distributed"]["sync_batchnorm"] = sync_batchnorm
    cfg["fault_tolerance"] = {"max_failures": 0}
    return cfg


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """2 workers with and without SyncBatchNorm, from the same seed."""
    out = tmp_path_factory.mktemp("image_runs")
    return {
        name: rt.train(image_config(out, name, 2, sync), progress=False)
        for name, sync in (("synced", True), ("unsynced", False))
    }


def rank_stats(result) -> list[dict[str, torch.Tensor]]:
    probe = result.run_dir.parent / f"{result.run_dir.name}_probe"
    return [torch.load(path, weights_only=True) for path in sorted(probe.glob("rank*.pt"))]


def test_sync_batchnorm_gives_both_ranks_identical_running_statistics(runs):
    ranks = rank_stats(runs["synced"])
    layers = [
        m for m in ResNetSmall(10, widths=tuple(WIDTHS)).modules() if type(m) is nn.BatchNorm2d
    ]
    assert len(ranks) == 2 and len(ranks[0]) == 2 * len(layers)  # running mean and var of each
    for key, value in ranks[0].items():
        assert torch.equal(value, ranks[1][key]), key


def test_without_sync_the_ranks_statistics_differ(runs):
    synced, unsynced = rank_stats(runs["synced"]), rank_stats(runs["unsynced"])
    # Each rank normalised its own half-batch: the last update differs between the ranks...
    assert any(not torch.allclose(v, unsynced[1][k]) for k, v in unsynced[0].items())
    # ...and from what statistics over the whole global batch gave.
    assert any(not torch.allclose(v, unsynced[0][k]) for k, v in synced[0].items())


def test_image_run_learns_and_reports_accuracy(runs):
    result = runs["synced"]
    with (result.run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2
    assert all(row["train_accuracy"] and row["val_accuracy"] for row in rows)
    assert result.metrics[-1]["val_accuracy"] > 0.25  # chance is 0.1
    assert rt.load_config(result.run_dir / "config.yaml").distributed.sync_batchnorm is True


def _val_images(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    splits = build_data(FactoryRef(**read_meta(checkpoint)["data_factory"]), 0)
    return splits.val.images, splits.val.labels


@pytest.mark.parametrize("name", ["synced", "unsynced"])
def test_val_accuracy_is_the_exact_global_value(runs, name):
    """Recomputed on one CPU over all 201 validation images, each counted once, with the
    checkpoint's weights: without SyncBatchNorm too, since every rank validates with rank
    0's BatchNorm statistics, the ones the checkpoint holds."""
    checkpoint = runs[name].checkpoint
    model = rt.load_model(checkpoint, trust_code=True)
    images, labels = _val_images(checkpoint)
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=1) == labels).double().mean().item()
    # Up to float32 rounding of each batch's mean; one image more or less would be 0.005.
    assert runs[name].metrics[-1]["val_accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_checkpoint_of_a_synced_model_loads_into_plain_batchnorm(runs):
    checkpoint = runs["synced"].checkpoint
    model = rt.load_model(checkpoint, trust_code=True)
    assert type(model) is ResNetSmall
    norms = {type(m) for m in model.modules() if "Norm" in type(m).__name__}
    assert norms == {nn.BatchNorm2d}
    state = torch.load(checkpoint / MODEL_FILE, weights_only=True)
    plain = ResNetSmall(num_classes=10, widths=tuple(WIDTHS))
    plain.load_state_dict(state)  # strict: the same keys as a model that never was synced
    # The checkpoint holds the statistics both ranks agreed on.
    for key, value in rank_stats(runs["synced"])[0].items():
        assert torch.equal(state[key], value), key


def test_predict_classifies_the_validation_images(runs, tmp_path):
    output, run_dir = tmp_path / "predictions.parquet", runs["synced"].run_dir
    # bn_probe is the test's own model (a user workload): its code runs when trusted.
    argv = ["predict", "--checkpoint", str(run_dir), "--output", str(output), "--trust-code"]
    assert main(argv) == 0
    table = pq.read_table(output).to_pydict()
    assert set(table) == {"pred_0", "true_0"} and len(table["pred_0"]) == 201
    correct = sum(p == t for p, t in zip(table["pred_0"], table["true_0"], strict=True))
    # A run directory predicts with its best checkpoint: the accuracy that one reported.
    reported = read_meta(find_checkpoint(run_dir))["metrics"]["val_accuracy"]
    assert correct / 201 == pytest.approx(reported)
