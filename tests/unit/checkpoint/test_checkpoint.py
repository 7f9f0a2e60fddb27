"""Checkpoints: unwrapping, the on-disk layout, RNG round trips, resolving paths, load_model."""

from __future__ import annotations

import json
import os
import random
import warnings
import zipfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.checkpoint.loading import find_checkpoint, load_model
from raytrain_app.checkpoint.store import (
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    TRAIN_STATE_FILE,
    DamagedCheckpointError,
    checkpoint_name,
    load_train_state,
    read_meta,
    save_checkpoint,
    unwrap_model,
    verify_checkpoint,
)
from raytrain_app.checkpoint.train_state import rng_state, set_rng_state
from raytrain_app.config import RaytrainConfig, config_to_dict
from raytrain_app.data import parquet_windows, synthetic_wind
from raytrain_app.errors import BadInputError
from raytrain_app.testing.ports import free_ports
from raytrain_app.workloads import BUILTIN_MODELS, FactoryRef, build_model


@pytest.fixture
def gloo_group():
    """A 1-process gloo group on CPU, so DDP can wrap a model; destroyed afterwards."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def compiled():
    """``torch.compile`` of a small model; compiling is lazy, so nothing is traced here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with warnings.catch_warnings():  # torch's own deprecations, raised while importing dynamo
        warnings.simplefilter("ignore", DeprecationWarning)
        return model, torch.compile(model)


# --------------------------------------------------------------------------- unwrap_model


def test_unwrap_plain_model_is_identity():
    model = nn.Linear(2, 2)
    assert unwrap_model(model) is model


def test_unwrap_strips_ddp(gloo_group):
    model = nn.Linear(3, 2)
    wrapped = nn.parallel.DistributedDataParallel(model)
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    assert unwrap_model(wrapped) is model


def test_unwrap_strips_torch_compile(compiled):
    model, wrapped = compiled
    assert wrapped is not model
    assert unwrap_model(wrapped) is model


def test_unwrap_strips_ddp_around_compile(gloo_group, compiled):
    model, wrapped = compiled
    assert unwrap_model(nn.parallel.DistributedDataParallel(wrapped)) is model


# --------------------------------------------------------------------------- save_checkpoint


def test_save_checkpoint_writes_the_files_and_their_manifest(tmp_path):
    model = nn.Linear(3, 2)
    train_state = {"epoch": 2, "step": 10, "optimizer": {"lr": 0.1}}
    meta = {"model_factory": {"target": "x:y"}, "data_info": {}, "config": {}}
    directory = save_checkpoint(
        tmp_path / "a" / "ckpt", model=model, train_state=train_state, meta=meta
    )
    assert directory == tmp_path / "a" / "ckpt"
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [MODEL_FILE, TRAIN_STATE_FILE, META_FILE, MANIFEST_FILE]
    )  # no temporary files left behind
    manifest = json.loads((directory / MANIFEST_FILE).read_text())["files"]
    assert manifest[MODEL_FILE]["size"] == (directory / MODEL_FILE).stat().st_size
    verify_checkpoint(directory)
    assert load_train_state(directory) == train_state
    assert read_meta(directory) == meta


def test_saved_weights_have_no_wrapper_prefixes(tmp_path, gloo_group, compiled):
    model, wrapped = compiled
    ddp = nn.parallel.DistributedDataParallel(wrapped)
    assert all(k.startswith("module._orig_mod.") for k in ddp.state_dict())
    save_checkpoint(tmp_path, model=ddp, train_state={}, meta={})
    state = torch.load(tmp_path / MODEL_FILE, weights_only=True)
    assert set(state) == set(model.state_dict())
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    fresh.load_state_dict(state)  # strict: loads into the bare module as is
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_saved_tensors_skip_the_zip_crc_the_manifest_already_checks_and_load_as_saved(tmp_path):
    """torch.save's CRC-32 of every record is a third of its CPU time; the manifest's
    SHA-256 is what a load verifies."""
    model = nn.Linear(64, 64)
    save_checkpoint(tmp_path, model=model, train_state={"step": 1}, meta={})
    with zipfile.ZipFile(tmp_path / MODEL_FILE) as archive:
        tensors = [r for r in archive.infolist() if "/data/" in r.filename]
        assert tensors and all(r.CRC == 0 for r in tensors)
    assert torch.serialization.get_crc32_options()  # as it was for everything else
    verify_checkpoint(tmp_path)
    for key, tensor in torch.load(tmp_path / MODEL_FILE, weights_only=True).items():
        assert torch.equal(tensor, model.state_dict()[key])


def test_save_checkpoint_overwrites_an_earlier_save(tmp_path):
    save_checkpoint(tmp_path, model=nn.Linear(1, 1), train_state={"epoch": 1}, meta={"epoch": 1})
    save_checkpoint(tmp_path, model=nn.Linear(1, 1), train_state={"epoch": 2}, meta={"epoch": 2})
    assert load_train_state(tmp_path)["epoch"] == 2
    assert read_meta(tmp_path)["epoch"] == 2


# --------------------------------------------------------------------------- RNG state


def _draw() -> tuple[list[float], list[float], list[float]]:
    return (
        torch.rand(5).tolist(),
        np.random.rand(5).tolist(),
        [random.random() for _ in range(5)],
    )


def test_rng_state_round_trip_reproduces_the_same_numbers():
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    state = rng_state()
    first = _draw()
    assert _draw() != first  # the generators moved on
    set_rng_state(state)
    assert _draw() == first


def test_rng_state_survives_a_checkpoint(tmp_path):
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    save_checkpoint(tmp_path, model=nn.Linear(1, 1), train_state={"rng": [rng_state()]}, meta={})
    expected = _draw()
    _draw()
    set_rng_state(load_train_state(tmp_path)["rng"][0])
    assert _draw() == expected


# --------------------------------------------------------------------------- find_checkpoint


def _saved_checkpoint(folder: Path, epoch: int, step: int, mtime: float = 1000.0) -> Path:
    directory = save_checkpoint(
        folder / checkpoint_name(epoch, step),
        model=nn.Linear(1, 1),
        train_state={"epoch": epoch, "step": step},
        meta={"epoch": epoch, "step": step},
    )
    os.utime(directory, (mtime, mtime))
    return directory


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_find_checkpoint_accepts_a_checkpoint_directory(tmp_path):
    ckpt = _saved_checkpoint(tmp_path, 1, 10)
    assert find_checkpoint(ckpt) == ckpt
    assert find_checkpoint(str(ckpt)) == ckpt


def test_find_checkpoint_takes_the_most_advanced_checkpoint_of_a_run(tmp_path):
    folder = tmp_path / "run" / "checkpoints" / "exp"
    _saved_checkpoint(folder, 1, 10, mtime=3000)  # touched last, but older progress
    newest = _saved_checkpoint(folder, 2, 25, mtime=1000)
    _saved_checkpoint(folder, 2, 20, mtime=2000)
    assert find_checkpoint(tmp_path / "run") == newest


def test_find_checkpoint_skips_damaged_checkpoints_of_a_run(tmp_path, caplog):
    folder = tmp_path / "run" / "checkpoints" / "exp"
    intact = _saved_checkpoint(folder, 1, 10)
    damaged = _saved_checkpoint(folder, 2, 20)
    _truncate(damaged / MODEL_FILE)
    with caplog.at_level("WARNING"):
        assert find_checkpoint(tmp_path / "run") == intact
    assert f"skipping the damaged checkpoint {damaged}" in caplog.text
    _truncate(intact / TRAIN_STATE_FILE)
    with pytest.raises(DamagedCheckpointError, match=r"model\.pt has \d+ bytes"):
        find_checkpoint(tmp_path / "run")  # every one damaged: the newest is reported


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda d: _truncate(d / MODEL_FILE), r"model\.pt has \d+ bytes, the manifest says \d+"),
        (lambda d: (d / META_FILE).write_text('{"epoch": 9, "step": 99}'), "meta.json has"),
        (
            lambda d: (d / TRAIN_STATE_FILE).write_bytes(
                bytes(b ^ 1 for b in (d / TRAIN_STATE_FILE).read_bytes())
            ),
            "train_state.pt does not match its checksum",
        ),
        (lambda d: (d / MODEL_FILE).unlink(), "model.pt is missing"),
        (lambda d: (d / MANIFEST_FILE).unlink(), "manifest.json is missing"),
        (lambda d: (d / MANIFEST_FILE).write_text("{"), "manifest.json is unreadable"),
    ],
)
def test_verify_checkpoint_names_the_damaged_file_in_one_line(tmp_path, damage, problem):
    directory = _saved_checkpoint(tmp_path, 1, 10)
    damage(directory)
    with pytest.raises(DamagedCheckpointError, match=problem) as info:
        verify_checkpoint(directory)
    message = str(info.value)
    assert "\n" not in message and str(directory) in message and "older checkpoint" in message
    with pytest.raises(DamagedCheckpointError):
        find_checkpoint(directory)  # a named checkpoint directory is verified too


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "run_without_checkpoints", "file"])
def test_find_checkpoint_rejects_other_paths_with_one_line(tmp_path, kind):
    path = tmp_path / "target"
    if kind == "empty_dir":
        path.mkdir()
    elif kind == "run_without_checkpoints":
        (path / "checkpoints").mkdir(parents=True)
        (path / "config.yaml").write_text("{}")
    elif kind == "file":
        path.write_text("not a checkpoint")
    with pytest.raises(BadInputError) as info:
        find_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message and "--checkpoint" in message


# --------------------------------------------------------------------------- load_model


@pytest.fixture(scope="module")
def wind_checkpoint(tmp_path_factory):
    """A checkpoint of the built-in wind model, saved as the training loop saves it."""
    root = tmp_path_factory.mktemp("wind")
    data_path = synthetic_wind.materialize(root / "data", num_turbines=2, num_hours=300, seed=0)
    splits = parquet_windows.build_windows(
        data_path,
        feature_columns=synthetic_wind.FEATURE_COLUMNS,
        target_column=synthetic_wind.TARGET_COLUMN,
        group_column=synthetic_wind.GROUP_COLUMN,
        time_column=synthetic_wind.TIME_COLUMN,
    )
    ref = FactoryRef(BUILTIN_MODELS["wind_transformer"], {})
    torch.manual_seed(0)
    spec = build_model(ref, dict(splits.info))
    with torch.no_grad():  # weights unlike any fresh initialisation
        for p in spec.module.parameters():
            p.add_(0.01)
    meta = {
        "model_factory": asdict(ref),
        "data_info": dict(splits.info),
        "config": config_to_dict(RaytrainConfig()),
    }
    ckpt = save_checkpoint(
        root / "run" / "checkpoints" / "quickstart" / "checkpoint_0",
        model=spec.module,
        train_state={"epoch": 1},
        meta=meta,
    )
    x = torch.stack([splits.val[i][0] for i in range(len(splits.val))])
    return spec.module, ckpt, x


def test_checkpoint_is_self_contained(wind_checkpoint, tmp_path):
    """load_model needs only the directory: meta carries factory, data info and config."""
    original, ckpt, x = wind_checkpoint
    meta = read_meta(ckpt)
    assert {"model_factory", "data_info", "config"} <= meta.keys()
    moved = tmp_path / "copied"
    moved.mkdir()
    # no data, no optimizer state, elsewhere on disk: what one ships for inference
    for name in (MODEL_FILE, META_FILE, MANIFEST_FILE):
        (moved / name).write_bytes((ckpt / name).read_bytes())
    original.eval()
    with torch.no_grad():
        assert torch.equal(load_model(moved)(x), original(x))


@pytest.mark.parametrize("via", ["checkpoint", "run_dir"])
def test_load_model_rebuilds_identical_model_on_cpu_in_eval_mode(wind_checkpoint, via):
    original, ckpt, x = wind_checkpoint
    loaded = load_model(ckpt if via == "checkpoint" else ckpt.parents[2])
    assert type(loaded) is type(original)
    assert loaded is not original
    assert not loaded.training
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    assert loaded.state_dict().keys() == original.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    original.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), original(x))


def test_load_model_of_a_missing_path_is_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="--checkpoint"):
        load_model(tmp_path / "nothing")
