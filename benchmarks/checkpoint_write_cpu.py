"""The machine's CPU time for writing one checkpoint: raytrain's writer around the page
cache (``checkpoint/direct_file.py``, ``O_DIRECT``) against the same writer through it.

On a host whose cores all train (this project's 2-core machine, or a CPU-heavy data
pipeline beside GPUs), every CPU second a background checkpoint takes is taken from the
training. Through the page cache part of that time is not the writer's own: the kernel's
page allocation and dirty-page writeback run in other threads (kworkers), so the writer
process's CPU time hides them. This counts every core's non-idle time (``/proc/stat``)
from the save's start until its bytes are on disk (``fsync``, which both variants pay).

Run on its own on a quiet machine: ``python -m benchmarks.checkpoint_write_cpu
[--repeats N] [--gb G]``. Prints each save's CPU seconds and the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from raytrain_app.checkpoint import direct_file
from raytrain_app.checkpoint.direct_file import DigestingFile

MB = 1 << 20


def busy_seconds() -> float:
    """CPU seconds all cores spent on anything but idle and I/O wait, since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def one_save(state: dict, path: Path, direct: bool) -> tuple[float, float]:
    """The machine's CPU seconds and the wall seconds of saving ``state`` to ``path``."""
    os.sync()  # nothing of an earlier write is left to be written meanwhile
    time.sleep(0.5)
    cpu, wall = busy_seconds(), time.perf_counter()
    with DigestingFile(path, direct=direct) as out:
        torch.save(state, out)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the page cache's writeback is part of the cost
    finally:
        os.close(fd)
    cpu, wall = busy_seconds() - cpu, time.perf_counter() - wall
    assert out.direct_bytes > 0 or not direct, "O_DIRECT was refused here: use a disk"
    path.unlink()
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gb", type=float, default=1.2, help="checkpoint size")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a folder on a disk")
    args = parser.parse_args()
    tensors = int(args.gb * 1024 * MB // (16 * MB))
    state = {f"w{i}": torch.randn(2048, 2048) for i in range(tensors)}  # 16 MB each
    path = Path(args.dir) / f"checkpoint-write-cpu-{os.getpid()}.pt"
    print(f"{tensors * 16} MB in {tensors} tensors, buffer {direct_file.BUFFER_BYTES // MB} MB")
    seen: dict[str, list[tuple[float, float]]] = {"around the page cache": [], "through it": []}
    for i in range(args.repeats):
        order = list(seen) if i % 2 == 0 else list(reversed(seen))  # alternate A B, B A
        for kind in order:
            seen[kind].append(one_save(state, path, direct=kind == "around the page cache"))
            cpu, wall = seen[kind][-1]
            print(f"  {kind}: {cpu:.2f} s of CPU, {wall:.2f} s")
    medians = {k: statistics.median(c for c, _ in v) for k, v in seen.items()}
    for kind, cpu in medians.items():
        wall = statistics.median(w for _, w in seen[kind])
        print(f"median, {kind}: {cpu:.2f} s of CPU, {wall:.2f} s")
    ratio = medians["around the page cache"] / medians["through it"]
    print(f"CPU around the page cache / through it: {ratio:.2f}")


if __name__ == "__main__":
    main()
