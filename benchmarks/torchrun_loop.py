"""raytrain's worker loop without Ray: the same ``WorkerLoop`` on a process group torchrun made.

    torchrun --standalone --nproc_per_node=2 benchmarks/torchrun_loop.py --config JSON

The DDP parity breakdown runs it between raytrain on Ray and the plain DDP script
(``torchrun_ddp.py``): raytrain-on-Ray / this = what Ray's runtime costs (its processes,
polls and scheduling), this / plain = what raytrain's loop does beyond a textbook loop (the
per-step agreement, global metric sums, the resumable sampler). It writes ``metrics.csv``
in the config's run directory like a raytrain run; checkpoints are written by the loop
and dropped here (persisting them is Ray's part, outside the timed epochs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from raytrain_app.config import config_from_dict, config_to_dict
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.planning.environment import detect_environment
from raytrain_app.planning.rules import make_plan, resolve_config
from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.workloads import model_factory, prepare_data


class TorchrunSession:
    """A ``WorkerSession`` on torchrun's process group (CPU, gloo)."""

    mid_epoch_checkpoints = False

    def __init__(self) -> None:
        self.world_rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def device(self) -> torch.device:
        return torch.device("cpu")

    def prepare_model(self, module: nn.Module, strategy: str, ddp_kwargs: dict) -> nn.Module:
        if strategy == "single" or self.world_size == 1:
            return module
        return nn.parallel.DistributedDataParallel(module, **ddp_kwargs)

    def prepare_loader(self, loader: DataLoader) -> DataLoader:
        return loader

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str | None):
        return None

    @contextlib.contextmanager
    def restored_checkpoint(self) -> Iterator[Path | None]:
        yield None

    def node_address(self) -> str:
        return "127.0.0.1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a raytrain config as JSON")
    cfg = config_from_dict(json.loads(parser.parse_args().config))
    dist.init_process_group("gloo")  # torchrun's env:// variables
    plan = make_plan(cfg, detect_environment())
    resolved = resolve_config(cfg, plan)
    run_dir = RunDirectory.for_config(resolved)
    if dist.get_rank() == 0:  # generate the data once; the other rank reads the cache
        run_dir.write_config(resolved)
        prepare_data(resolved.data, run_dir.data, resolved.experiment.seed)
    dist.barrier()
    task = WorkerTask(
        config=config_to_dict(resolved),
        plan=plan,
        data=prepare_data(resolved.data, run_dir.data, resolved.experiment.seed),
        model=model_factory(resolved.model),
        run_dir=str(run_dir.root),
    )
    WorkerLoop(task, TorchrunSession()).run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
