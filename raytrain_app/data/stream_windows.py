"""Streaming forecasting windows: the data factory workers call for prepared Parquet data.

The driver prepares the data once (``stream_prepare``) into a folder every node sees and
names it in this factory's params; each worker then only reads the manifest here, and its
batches stream from the prepared files (``worker.stream_batches``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from raytrain_app.data.stream_manifest import Split, StreamManifest
from raytrain_app.data.stream_reader import PreparedFiles, WindowBlock, load_manifest, read_windows
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import CollatedBatch, CollateFn, collate

# This module owns the streaming factory: checkpoints' meta.json name it, and the factory
# gate (``checkpoint.trust``) counts it as built in.
FACTORY = "raytrain_app.data.stream_windows:build"


@dataclass(frozen=True)
class StreamSplits:
    """What the streaming factory returns instead of ``DataSplits``: where the prepared
    data is, and the same ``info`` the in-memory windows would give."""

    manifest: StreamManifest
    folder: str
    info: Mapping[str, Any] = field(default_factory=dict)

    def files(self) -> PreparedFiles:
        return PreparedFiles(self.manifest, self.folder)

    def preview(self, split: Split, limit: int = 64) -> Dataset:
        """The first ``limit`` windows of ``split``, in memory: for the checks that run a
        batch before training (``train.monitor``, the memory probe)."""
        count = min(limit, self.manifest.chunks(split).num_windows)
        ids = np.arange(count, dtype=np.int64)
        return _BlockDataset(read_windows(self.files(), split, ids))

    def batch_collate(self) -> CollateFn:
        """Prepared windows are all one shape: raytrain's own collate batches them."""
        return collate


class _BlockDataset(Dataset):
    """A ``WindowBlock`` as a map-style dataset with batched fetching."""

    def __init__(self, block: WindowBlock) -> None:
        self.block = block

    def __len__(self) -> int:
        return len(self.block.ids)

    def __getitem__(self, index: int) -> tuple:
        x, y = self.block.gather(np.asarray([index]))
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> CollatedBatch:
        return CollatedBatch(self.block.gather(np.asarray(indices, dtype=np.int64)))


def build(params: Mapping[str, Any], seed: int) -> StreamSplits:
    """Protocol data factory of prepared data: ``params`` holds ``folder``, the folder of
    its ``manifest.json`` (a local path every node sees, or a URI)."""
    del seed  # the order is the loaders' (seeded there); the data itself is fixed
    folder = params.get("folder")
    if not isinstance(folder, str):
        raise BadInputError("streaming data needs params.folder: the prepared data's folder")
    manifest = load_manifest(folder)
    return StreamSplits(manifest=manifest, folder=folder, info=manifest.info())
