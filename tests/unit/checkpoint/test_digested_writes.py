"""A checkpoint's .pt files are digested as they are written (``direct_file.DigestingFile``),
not read again for the manifest: what the manifest says must still be the files on disk,
byte for byte, however the operating system splits the writes."""

from __future__ import annotations

import hashlib
import json
import os

import torch
from torch import nn

from raytrain_app.checkpoint import store


def _on_disk(path) -> dict:
    return {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _save(directory) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    store.save_checkpoint(
        directory,
        model=model,
        ema=model,
        train_state={"optimizer": optimizer.state_dict(), "epoch": 1, "step": 3},
        meta={"epoch": 1, "step": 3},
    )
    return model


def test_the_manifest_lists_the_files_as_they_are_on_disk(tmp_path):
    model = _save(tmp_path)
    manifest = json.loads((tmp_path / store.MANIFEST_FILE).read_text())["files"]
    assert set(manifest) == {
        store.MODEL_FILE,
        store.EMA_FILE,
        store.TRAIN_STATE_FILE,
        store.META_FILE,
    }
    for name, listed in manifest.items():
        assert listed == _on_disk(tmp_path / name), name
    store.verify_checkpoint(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    loaded = store.load_tensors(tmp_path / store.MODEL_FILE)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key


def test_writes_the_system_takes_in_part_are_finished(tmp_path, monkeypatch):
    """``write()`` may take fewer bytes than it is given (at most 2 GiB on Linux, fewer
    on a full pipe or a signal): the rest is written, and digested once."""
    real_write = os.write
    calls = []

    def write_at_most_4_kib(fd, data):
        calls.append(len(data))
        return real_write(fd, memoryview(data)[:4096])

    monkeypatch.setattr(store.os, "write", write_at_most_4_kib)
    _save(tmp_path)
    monkeypatch.undo()
    assert max(calls) > 4096  # some records were split
    manifest = json.loads((tmp_path / store.MANIFEST_FILE).read_text())["files"]
    for name, listed in manifest.items():
        assert listed == _on_disk(tmp_path / name), name
    store.verify_checkpoint(tmp_path)
