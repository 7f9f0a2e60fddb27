"""The built-in image workload: procedural images, augmentation, the small ResNet (no Ray)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import raytrain_app as rt
from raytrain_app.config import config_from_dict, load_config
from raytrain_app.data import synthetic_images as si
from raytrain_app.errors import BadInputError
from raytrain_app.models import resnet_small as rs
from raytrain_app.planning.environment import detect_environment
from raytrain_app.planning.rules import make_plan
from raytrain_app.protocol import ModelSpec
from raytrain_app.workloads import FactoryRef, build_data, check_sources, prepare_data

CONFIGS = Path(rt.__file__).parent / "configs"
SMALL = {"num_train": 64, "num_val": 30, "image_size": 16, "pad": 2}


# --------------------------------------------------------------------------- data


def test_same_seed_same_images_other_seed_other_images():
    a, b, c = si.build(SMALL, 0), si.build(SMALL, 0), si.build(SMALL, 1)
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.val.labels, b.val.labels)
    assert not torch.equal(a.train.images, c.train.images)


def test_images_labels_and_info():
    splits = si.build({**SMALL, "num_train": 500}, 0)
    assert (len(splits.train), len(splits.val)) == (500, 30)
    image, label = splits.val[0]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert label.dtype == torch.int64
    assert set(splits.train.labels.tolist()) == set(range(10))  # every class occurs
    images = splits.train.images
    assert abs(float(images.mean())) < 0.2 and 0.8 < float(images.std()) < 1.2  # standardised
    assert splits.info == {
        "num_classes": 10,
        "in_channels": 3,
        "image_size": 16,
        "class_names": list(si.CLASS_NAMES),
    }


def _augmented(splits, epoch: int) -> torch.Tensor:
    splits.train.set_epoch(epoch)
    return torch.stack([splits.train[i][0] for i in range(len(splits.train))])


def test_augmentation_is_a_function_of_seed_epoch_and_index():
    splits = si.build(SMALL, 0)
    first = _augmented(splits, 0)
    torch.manual_seed(123)  # the global RNG plays no part
    torch.rand(10)
    assert torch.equal(_augmented(si.build(SMALL, 0), 0), first)
    # Reading in another order (another rank's shard, a resumed epoch) changes nothing.
    splits.train.set_epoch(0)
    assert all(torch.equal(splits.train[i][0], first[i]) for i in reversed(range(len(first))))
    second = _augmented(splits, 1)
    changed = [not torch.equal(a, b) for a, b in zip(first, second, strict=True)]
    assert sum(changed) > len(changed) // 2  # a new epoch, new crops and flips
    assert torch.equal(_augmented(splits, 0), first)


def test_augmentation_is_a_padded_crop_possibly_flipped():
    splits = si.build(SMALL, 0)
    pad, size = SMALL["pad"], SMALL["image_size"]
    for index in range(8):
        original = nn.functional.pad(splits.train.images[index], (pad,) * 4)
        crops = [
            original[:, dy : dy + size, dx : dx + size]
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
        ]
        crops += [crop.flip(-1) for crop in crops]
        augmented = splits.train[index][0]
        assert any(torch.equal(augmented, crop) for crop in crops)


def test_validation_and_augment_false_return_the_stored_images():
    splits = si.build({**SMALL, "augment": False}, 0)
    splits.train.set_epoch(3)
    assert torch.equal(splits.train[5][0], splits.train.images[5])
    assert torch.equal(si.build(SMALL, 0).val[5][0], splits.val.images[5])


def test_persistent_loader_processes_see_each_new_epoch():
    """__getitem__ runs in the loader's worker process, which outlives the epoch."""
    splits = si.build(SMALL, 0)
    loader = DataLoader(splits.train, batch_size=16, num_workers=1, persistent_workers=True)
    for epoch in (0, 1, 2):
        splits.train.set_epoch(epoch)
        loaded = torch.cat([images for images, _ in loader])
        assert torch.equal(loaded, _augmented(splits, epoch)), epoch


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"num_samples": 10}, "data.params.num_samples"),
        ({"image_size": 4}, "data.params.image_size"),
        ({"num_train": 0}, "data.params.num_train"),
        ({"pad": 16, "image_size": 16}, "data.params.pad"),
        ({"augment": "yes"}, "data.params.augment"),
        ({"noise": -1}, "data.params.noise"),
    ],
)
def test_bad_data_params_name_the_key(params, key):
    with pytest.raises(BadInputError, match=key):
        si.build(params, 0)


# --------------------------------------------------------------------------- model


@pytest.mark.parametrize(("size", "widths"), [(16, [8]), (32, [16, 32, 64])])
def test_resnet_maps_images_to_class_logits(size, widths):
    spec = rs.build({"widths": widths}, {"num_classes": 10, "in_channels": 3})
    assert spec.module(torch.randn(5, 3, size, size)).shape == (5, 10)
    norms = [m for m in spec.module.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) >= 2 * len(widths)


class _FixedLogits(nn.Module):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_step_returns_cross_entropy_and_accuracy_as_sample_means():
    logits = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 1, 1, 1])
    out = rs.step(_FixedLogits(logits), (torch.zeros(4, 3, 8, 8), labels))
    assert out.num_samples == 4
    assert out.metrics["accuracy"].item() == pytest.approx(0.75)
    assert out.loss.item() == pytest.approx(nn.functional.cross_entropy(logits, labels).item())
    assert torch.equal(rs.predict(_FixedLogits(logits), (None, labels)), torch.tensor([0, 1, 0, 1]))


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"depth": 3}, "model.params.depth"),
        ({"widths": []}, "model.params.widths"),
        ({"widths": [16, 0]}, "model.params.widths"),
        ({"blocks_per_stage": 0}, "model.params.blocks_per_stage"),
    ],
)
def test_bad_model_params_name_the_key(params, key):
    with pytest.raises(BadInputError, match=key):
        rs.build(params, {"num_classes": 10})


def test_spec_pickles():
    spec = rs.build({}, {"num_classes": 10})
    assert isinstance(pickle.loads(pickle.dumps(spec)), ModelSpec)


def test_a_few_steps_learn_above_chance(one_thread):
    splits = si.build({"num_train": 1024, "num_val": 256, "image_size": 16}, 0)
    torch.manual_seed(0)
    spec = rs.build({"widths": [16, 32]}, splits.info)
    optimizer = torch.optim.AdamW(spec.module.parameters(), lr=3e-3)
    for _ in range(2):
        for batch in DataLoader(splits.train, batch_size=64, shuffle=True):
            optimizer.zero_grad()
            spec.step(spec.module, batch).loss.backward()
            optimizer.step()
    spec.module.eval()
    with torch.no_grad():
        accuracy = rs.step(spec.module, next(iter(DataLoader(splits.val, batch_size=256))))
    assert accuracy.metrics["accuracy"] > 0.3  # chance is 0.1


# --------------------------------------------------------------------------- workload wiring


def test_builtin_names_resolve_and_need_no_driver_side_data(tmp_path):
    cfg = config_from_dict(
        {"model": {"name": "resnet_small"}, "data": {"name": "synthetic_images", "params": SMALL}}
    )
    check_sources(cfg.model, cfg.data)
    ref = prepare_data(cfg.data, tmp_path / "data", seed=0)
    assert ref == FactoryRef("raytrain_app.data.synthetic_images:build", SMALL, "data.name")
    assert not (tmp_path / "data").exists()
    assert len(build_data(ref, 0).train) == SMALL["num_train"]


def test_unknown_image_data_param_fails_before_anything_runs():
    cfg = config_from_dict({"data": {"name": "synthetic_images", "params": {"stride": 2}}})
    with pytest.raises(BadInputError, match=r"data\.params\.stride.*num_train"):
        check_sources(cfg.model, cfg.data)


def test_the_shipped_image_config_plans_two_workers_with_sync_batchnorm():
    cfg = load_config(CONFIGS / "image.yaml")
    assert (cfg.model.name, cfg.data.name) == ("resnet_small", "synthetic_images")
    check_sources(cfg.model, cfg.data)
    plan = make_plan(cfg, detect_environment())
    assert plan.world_size == 2 and plan.sync_batchnorm and plan.dataloader_workers == 1
