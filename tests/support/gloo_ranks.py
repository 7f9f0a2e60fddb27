"""Two real gloo processes on this machine, without Ray, for unit tests of distributed code."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain_app.testing.ports import free_ports


def _rank_main(
    rank: int, port: int, fn: Callable[[int], Any], out_dir: str, timeout_s: float
) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        torch.save(fn(rank), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_on_two_ranks(fn: Callable[[int], Any], out_dir: Path, timeout_s: float = 1800) -> list[Any]:
    """``fn(rank)`` in each of two gloo processes; what each returned (through torch.save).

    ``fn`` must be a module-level function: the processes are spawned and import it.
    ``timeout_s``: how long a collective may wait for the other rank before it fails.
    """
    args = (free_ports(1)[0], fn, str(out_dir), timeout_s)
    mp.spawn(_rank_main, args=args, nprocs=2, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(2)]
