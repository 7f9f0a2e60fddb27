"""One function moves every batch raytrain moves (``session.to_device``): the loaders of
every session and the memory probe. Batches go to the ``meta`` device, which any machine
has: a tensor left behind is still on the CPU.

Before it was one function with Ray's rules, a NamedTuple batch crashed the move and a
``UserDict``, a Hugging Face ``BatchEncoding`` or a dataclass stayed on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections import OrderedDict, UserDict, defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from batch_shapes import Encoding
from loop_harness import make_task
from torch import nn
from torch.utils.data import DataLoader

from raytrain_app.config import config_from_dict
from raytrain_app.protocol import ModelSpec, StepOutput, collate
from raytrain_app.worker.device_batches import _DeviceLoader, to_device
from raytrain_app.worker.memory_probe import fit_plan_to_memory
from raytrain_app.worker.session import InProcessSession, RayTrainSession

META = torch.device("meta")


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Sample:
    images: torch.Tensor
    labels: torch.Tensor
    name: str = "batch"
    size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", int(self.labels.shape[0]))


class Lookup(Mapping):
    """A read-only Mapping whose constructor takes a dict, and means something else by it."""

    def __init__(self, *pairs: tuple[str, Any]) -> None:
        self._items = dict(pairs)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _t(*shape: int) -> torch.Tensor:
    return torch.ones(*shape)


def _leaves(batch: Any) -> list[Any]:
    """Every leaf of ``batch`` (tensors and anything else), walked independently of the
    function under test."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [leaf for value in batch.values() for leaf in _leaves(value)]
    if isinstance(batch, tuple | list):
        return [leaf for item in batch for leaf in _leaves(item)]
    if dataclasses.is_dataclass(batch):
        return [leaf for f in dataclasses.fields(batch) for leaf in _leaves(getattr(batch, f.name))]
    return [batch]


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [leaf for leaf in _leaves(batch) if isinstance(leaf, torch.Tensor)]


BATCHES = {
    "tensor": _t(2),
    "tuple": (_t(2), _t(3)),
    "list": [_t(2), _t(3)],
    "named_tuple": Pair(_t(2, 3), _t(2)),
    "dict": {"x": _t(2), "y": _t(3)},
    "user_dict": UserDict(x=_t(2), y=_t(3)),
    "batch_encoding": Encoding({"input_ids": _t(2, 5), "mask": _t(2, 5)}, encodings=[[0, 1]]),
    "ordered_dict": OrderedDict(x=_t(2)),
    "defaultdict": defaultdict(list, x=_t(2)),
    "mapping_proxy": types.MappingProxyType({"x": _t(2)}),
    "dataclass": Sample(_t(2, 3), _t(2)),
    "nested": {
        "pair": Pair(_t(2), [Sample(_t(1), _t(1)), {"deep": (_t(1),)}]),
        "text": Encoding({"ids": _t(2)}),
        "meta": {"names": ["a", "b"], "step": 3, "none": None, "array": np.zeros(2)},
    },
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_every_tensor_moves_and_every_container_keeps_its_type(name):
    batch = BATCHES[name]
    moved = to_device(batch, META)
    tensors = _tensors(moved)
    assert tensors and all(t.device == META for t in tensors)
    assert type(moved) is type(batch)
    # Everything else is passed through untouched, in the same places.
    before, after = _leaves(batch), _leaves(moved)
    assert len(after) == len(before)
    for old, new in zip(before, after, strict=True):
        assert isinstance(new, torch.Tensor) if isinstance(old, torch.Tensor) else new is old
    # The batch itself is left as it was: a loader or a dataset may hold it.
    assert all(t.device.type == "cpu" for t in _tensors(batch))


def test_containers_keep_what_they_hold_besides_their_items():
    encoding = to_device(BATCHES["batch_encoding"], META)
    assert encoding.input_ids.device == META  # attribute access, as BatchEncoding's
    assert encoding.word_ids(0) == [0, 1]  # the tokenizer's encodings came along
    sample = to_device(BATCHES["dataclass"], META)
    assert (sample.name, sample.size) == ("batch", 2)  # the derived field is derived again
    assert to_device(BATCHES["defaultdict"], META).default_factory is list
    pair = to_device(BATCHES["named_tuple"], META)
    assert pair.x.shape == (2, 3) and pair.y.device == META


def test_a_mapping_that_cannot_be_rebuilt_arrives_as_a_dict_as_in_ray():
    moved = to_device(Lookup(("x", _t(2)), ("y", "label")), META)
    assert type(moved) is dict
    assert moved["x"].device == META and moved["y"] == "label"


def _named_tuple_loader() -> DataLoader:
    samples = [Pair(torch.full((3,), float(i)), torch.tensor(float(i))) for i in range(8)]
    return DataLoader(samples, batch_size=4)  # torch's collate keeps the NamedTuple


def test_every_session_s_loader_moves_batches_with_the_same_function(monkeypatch):
    # The Ray Train session used Ray's own loader, whose rules differ (a NamedTuple came
    # out a plain tuple); it now moves batches as every other session does.
    monkeypatch.setattr(RayTrainSession, "device", lambda self: META)
    ray_session = RayTrainSession.__new__(RayTrainSession)  # no Ray Train context needed
    for session in (InProcessSession(device="meta"), ray_session):
        batches = list(session.prepare_loader(_named_tuple_loader()))
        assert len(batches) == 2
        for batch in batches:
            assert type(batch) is Pair
            assert batch.x.device == META and batch.y.device == META


def test_a_named_tuple_batch_goes_through_the_memory_probe(tmp_path):
    """The probe moves its batches itself (before any loader exists): a step that reads
    ``batch.x`` gets a NamedTuple; more than 4 samples run out of memory (a stand-in)."""
    torch.manual_seed(0)
    module = nn.Linear(3, 1)

    def step(model: nn.Module, batch: Pair) -> StepOutput:
        if batch.x.shape[0] > 4:
            raise torch.OutOfMemoryError("stand-in for the GPU running out of memory")
        loss = nn.functional.mse_loss(model(batch.x).squeeze(1), batch.y)
        return StepOutput(loss=loss, num_samples=batch.x.shape[0])

    samples = [Pair(torch.randn(3), torch.randn(())) for _ in range(32)]
    task = make_task(tmp_path, epochs=1, global_batch_size=16, max_batch_per_worker="auto")
    plan = replace(task.plan, per_worker_batch_size=16, grad_accum_steps=1, memory_probe=True)
    fitted = fit_plan_to_memory(
        plan,
        ModelSpec(module=module, step=step),
        module,
        samples,
        contextlib.nullcontext,
        torch.device("cpu"),
        world_size=1,
        collate=collate,
        train=config_from_dict(task.config).train,
    )
    assert (fitted.per_worker_batch_size, fitted.grad_accum_steps) == (4, 4)


def test_on_a_gpu_the_next_batch_is_copied_while_the_current_one_trains(monkeypatch):
    """The order of the GPU loader's side-stream copies (as Ray's loader does them), with
    torch.cuda's streams replaced by a log: a batch is handed over only after the training
    stream waited for its copy, and the next batch's copy is queued before the hand-over,
    so that it runs while the current batch trains. On a GPU: tests/gpu/test_gpu_in_process.py."""
    log: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            log.append(f"{self.name} waits for {other.name}")

    copies, training = Stream("copies"), Stream("training")

    @contextlib.contextmanager
    def on(stream: Stream) -> Iterator[None]:
        log.append(f"copy on {stream.name}")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: copies)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: training)
    monkeypatch.setattr(torch.cuda, "stream", on)
    batches = _DeviceLoader(_named_tuple_loader(), META)._prefetched()
    first = next(batches)
    assert log == ["copy on copies", "training waits for copies", "copy on copies"]
    assert type(first) is Pair and first.x.device == META
    log.clear()
    assert [type(b) for b in batches] == [Pair]
    assert log == ["training waits for copies"]  # the last batch: nothing left to copy
