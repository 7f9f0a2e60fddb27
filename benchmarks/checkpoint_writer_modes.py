"""Thread or process for the checkpoint writer: what a background save of a 1.2 GB state
(torch.save without per-record CRC-32, and each file's SHA-256) costs the training thread,
written as raytrain's writer did until 2026-11-27 (torch.save to a path, then a second
read for the digest) and as it does now (``checkpoint/store.py``: torch.save into a file
object that digests the bytes as they pass, the GIL let go while it writes).

Run on its own, not by ``benchmarks.run``: ``python -m benchmarks.checkpoint_writer_modes
[--repeats N]``. Prints three measurements (benchmarks/README.md, "Checkpoints off the
step's path"):

- how long another Python thread goes without the GIL while a thread runs torch.save of
  one 400 MB tensor (with and without the CRC), SHA-256 of that file, or a tensor copy;
- the rate of a thread issuing small torch ops (as a GPU loop launches kernels) while a
  writer thread or a writer process saves the 1.2 GB state, over its rate alone;
- the seconds per save a one-worker 100M-parameter AdamW loop (1 torch thread) loses
  with a writer thread or a writer process, against the same loop without saves.

The writer's buffers are allocated once and refilled at each save (in shared memory for
the process), as ``checkpoint.snapshot.HostCopies`` does.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.serialization import config

from raytrain_app.checkpoint import store

WIDTH, LAYERS, BATCH, STEPS, SAVES_AT = 2048, 24, 8, 18, (2, 10)
SCRATCH = Path(tempfile.gettempdir())


def save_without_crc(state: Any, path: Path) -> None:
    with config.patch("save.compute_crc32", False):
        torch.save(state, path)


def write(state: Any, path: Path) -> None:
    """What raytrain's writer did with a snapshot until 2026-11-27: torch.save to a path,
    then the file's SHA-256 (a second read of it)."""
    save_without_crc(state, path)
    with path.open("rb") as f:
        hashlib.file_digest(f, "sha256")
    path.unlink()


def write_as_raytrain(state: Any, path: Path) -> None:
    """What raytrain's writer does now (``checkpoint/store.py``): torch.save into a file
    object that digests the bytes as they pass, the GIL let go while it writes."""
    store._atomic_torch_save(state, path)
    path.unlink()


def _writer_process(state: Any, todo: Any, done: Any) -> None:
    torch.set_num_threads(1)
    while todo.get() is not None:
        write(state, SCRATCH / f"writer-modes-{os.getpid()}.pt")
        done.put(True)


class Writer:
    """Saves ``state`` in a thread of this process, or in a process of its own."""

    def __init__(self, state: Any, process: bool, saves: Callable[..., None] = write) -> None:
        self.state, self.process, self.saves = state, process, saves
        self._thread: threading.Thread | None = None
        if process:
            ctx = mp.get_context("spawn")
            self.todo, self.done = ctx.Queue(), ctx.Queue()
            self.child = ctx.Process(target=_writer_process, args=(state, self.todo, self.done))
            self.child.start()
            self.todo.put(True)  # started and ready: its first save is not timed
            self.done.get()

    def start(self) -> None:
        if self.process:
            self.todo.put(True)
            return
        path = SCRATCH / f"writer-modes-{os.getpid()}.pt"
        self._thread = threading.Thread(target=self.saves, args=(self.state, path))
        self._thread.start()

    def wait(self) -> None:
        if self.process:
            self.done.get()
        elif self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        if self.process:
            self.todo.put(None)
            self.child.join()


def longest_gil_gap(work: Callable[[], Any]) -> float:
    """The longest this thread went between two of its bytecodes while ``work`` ran in
    another thread."""
    worker = threading.Thread(target=work)
    worker.start()
    worst, last = 0.0, time.perf_counter()
    while worker.is_alive():
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst


def launch_rate(writer: Writer | None) -> float:
    """Small torch ops per second in this thread, during one save (or 3 s without)."""
    x, ops, start = torch.zeros(64), 0, time.perf_counter()
    done = threading.Event()
    if writer is None:
        threading.Timer(3.0, done.set).start()
    else:
        writer.start()
        threading.Thread(target=lambda: (writer.wait(), done.set())).start()
    while not done.is_set():
        x.add_(1)
        ops += 1
    return ops / (time.perf_counter() - start)


def _shared_state(share: bool) -> dict[str, torch.Tensor]:
    state = {f"w{i}": torch.randn(WIDTH, WIDTH) for i in range(72)}  # 72 x 16 MB = 1.2 GB
    return {k: v.share_memory_() for k, v in state.items()} if share else state


def _tensors(model: nn.Module, opt: Any) -> list[torch.Tensor]:
    """The weights and AdamW's moments: what a checkpoint holds."""
    moments = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    return [*model.state_dict().values(), *moments]


def loop_seconds(writer: Writer | None, model: nn.Module, opt: Any) -> float:
    """Seconds of ``STEPS`` AdamW steps, saving into the writer's buffers at ``SAVES_AT``."""
    x, start, in_flight = torch.randn(BATCH, WIDTH), time.perf_counter(), False
    for i in range(STEPS):
        if writer is not None and i in SAVES_AT:
            if in_flight:
                writer.wait()  # one save in flight
            for buffer, tensor in zip(writer.state, _tensors(model, opt), strict=True):
                buffer.copy_(tensor)
            writer.start()
            in_flight = True
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    if in_flight:
        writer.wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    torch.set_num_threads(1)
    big = torch.randn(100_000_000)
    path = SCRATCH / f"writer-modes-gil-{os.getpid()}.pt"
    for name, work in [
        ("torch.save of one 400 MB tensor, with its CRC", lambda: torch.save({"w": big}, path)),
        ("the same without the CRC", lambda: save_without_crc({"w": big}, path)),
        (
            "raytrain's save (no CRC, digested as written)",
            lambda: store._atomic_torch_save({"w": big}, path),
        ),
        ("SHA-256 of that file", lambda: hashlib.file_digest(path.open("rb"), "sha256")),
        ("a 400 MB tensor copy", lambda: torch.empty_like(big).copy_(big)),
    ]:
        print(f"GIL: {name}: longest gap {longest_gil_gap(work):.3f} s")
    path.unlink()

    state = _shared_state(False)
    writers = {
        "thread, torch.save to a path, then SHA-256": Writer(state, process=False),
        "thread, raytrain's save": Writer(state, process=False, saves=write_as_raytrain),
        "process, torch.save to a path, then SHA-256": Writer(_shared_state(True), process=True),
    }
    for _ in range(repeats):
        alone = launch_rate(None)
        for kind, writer in writers.items():
            print(f"ops rate with a writer {kind}: {launch_rate(writer) / alone:.2f} of alone")
    for writer in writers.values():
        writer.close()

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    model = nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loop_seconds(None, model, opt)  # optimizer state exists
    lost: dict[str, list[float]] = {"thread": [], "process": []}
    for _ in range(repeats):
        base = loop_seconds(None, model, opt)
        for kind in lost:
            buffers = [torch.empty_like(t) for t in _tensors(model, opt)]
            if kind == "process":
                buffers = [b.share_memory_() for b in buffers]
            writer = Writer(buffers, process=kind == "process")
            lost[kind].append((loop_seconds(writer, model, opt) - base) / len(SAVES_AT))
            writer.close()
            print(f"AdamW loop, writer {kind}: {lost[kind][-1]:.2f} s lost per save")
        print(f"  (step {base / STEPS:.2f} s without saves)")
    for kind, values in lost.items():
        print(f"median, writer {kind}: {statistics.median(values):.2f} s lost per save")


if __name__ == "__main__":
    main()
