"""Batches moved to the worker's device: the one rule for every batch raytrain moves (the
loaders of every session, the memory probe, Ray Data's batches)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

logger = logging.getLogger(__name__)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device``: the one rule for every batch raytrain
    moves (the loaders of every session, the memory probe).

    Ray's loader rules, kept where they agree: tensors move; lists, tuples and any
    ``Mapping`` are walked; anything else is passed through as it is. Unlike Ray's, the
    containers keep their type, since a step may read ``batch.images`` or call a tokenizer
    output's methods: a NamedTuple is rebuilt field by field, a ``dict`` subclass or
    ``UserDict`` (a Hugging Face ``BatchEncoding``) is copied with its other state (the
    encodings), another Mapping is rebuilt from a dict where its type allows (else it
    becomes the dict, as Ray makes every Mapping), and a dataclass is replaced field by
    field.
    """
    # Asynchronous only to a GPU: a copy back to the host must be complete when read.
    non_blocking = device.type == "cuda"
    return _map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` rebuilt with ``fn`` applied to every tensor in it (``to_device``'s rules)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return _rebuilt_mapping(batch, {k: _map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(type(batch), "_fields"):  # a NamedTuple
        return type(batch)(*(_map_tensors(item, fn) for item in batch))
    if isinstance(batch, tuple | list):
        items = [_map_tensors(item, fn) for item in batch]
        return items if type(batch) is list else type(batch)(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: _map_tensors(getattr(batch, f.name), fn)
            for f in dataclasses.fields(batch)
            if f.init  # the others are derived by the dataclass itself (__post_init__)
        }
        return dataclasses.replace(batch, **changes)
    return batch


def _rebuilt_mapping(batch: Mapping, moved: dict) -> Mapping:
    """``moved`` as the Mapping type of ``batch``."""
    if type(batch) is dict:
        return moved
    if isinstance(batch, dict | UserDict):
        # A copy keeps the type and what else it holds (a defaultdict's factory, a
        # BatchEncoding's encodings); replacing its values leaves ``batch`` as it was.
        rebuilt = copy.copy(batch)
        rebuilt.update(moved)
        return rebuilt
    try:
        rebuilt = type(batch)(moved)
    except (TypeError, ValueError):
        rebuilt = None
    # A constructor may take the dict and mean something else by it: keep only a faithful
    # copy, holding the very values moved.
    faithful = isinstance(rebuilt, Mapping) and rebuilt.keys() == moved.keys()
    if faithful and all(rebuilt[key] is value for key, value in moved.items()):
        return rebuilt
    logger.debug("%s cannot be rebuilt from a dict; the batch is a dict", type(batch))
    return moved


def on_device(loader: DataLoader, device: torch.device) -> Any:
    """``loader`` whose batches arrive on ``device`` (``loader`` itself for the CPU)."""
    return loader if device.type == "cpu" else _DeviceLoader(loader, device)


class _DeviceLoader:
    """Iterates a DataLoader with every batch moved to ``device`` by ``to_device``.

    On a GPU the next batch is copied on a side stream while the current one trains, as
    Ray's own loader does (``prepare_data_loader``'s ``auto_transfer``): the training
    stream waits for a batch's copy only when it takes that batch.
    """

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            return (to_device(batch, self.device) for batch in self.loader)
        return self._prefetched()

    def _prefetched(self) -> Iterator[Any]:
        copies = torch.cuda.Stream(self.device)
        batches = iter(self.loader)
        pending = self._staged(next(batches, _END), copies)
        while pending is not _END:
            torch.cuda.current_stream(self.device).wait_stream(copies)
            ready, pending = pending, self._staged(next(batches, _END), copies)
            yield ready

    def _staged(self, batch: Any, copies: torch.cuda.Stream) -> Any:
        """``batch`` copied to the device on the ``copies`` stream, its memory kept from
        reuse until the training stream is done with it (``record_stream``)."""
        if batch is _END:
            return _END
        training = torch.cuda.current_stream(self.device)

        def copy_for_training(tensor: torch.Tensor) -> torch.Tensor:
            moved = tensor.to(self.device, non_blocking=True)
            if moved.device.type == "cuda":
                moved.record_stream(training)
            return moved

        with torch.cuda.stream(copies):
            return _map_tensors(batch, copy_for_training)

    def __len__(self) -> int:
        return len(self.loader)


_END = object()  # the end of a loader's batches (a batch may be anything, None included)
