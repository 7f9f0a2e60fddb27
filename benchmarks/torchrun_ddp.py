"""Plain DDP on gloo, launched by torchrun: the baseline for raytrain's 2-worker epoch time.

    torchrun --standalone --nproc_per_node=2 benchmarks/torchrun_ddp.py --data-dir D --out F

The same workload as raytrain (its data and model factories), the same batch split (the
global batch over the ranks, the tail dropped), a DistributedSampler with the same seed and
``set_epoch``, AdamW, grad clip 1.0, LambdaLR per step, one intra-op thread per process.
Rank 0 writes the training time of every epoch to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_app.config import DataConfig, ModelConfig
from raytrain_app.planning.batch import lr_factor
from raytrain_app.workloads import build_data, build_model, model_factory, prepare_data

SEED = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="where the synthetic data is cached")
    parser.add_argument("--data-params", default='{"stride": 4}', help="JSON data.params")
    parser.add_argument("--model-target", default=None, help="model factory, default built-in")
    parser.add_argument("--model-params", default="{}", help="JSON model.params")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.0e-3)
    parser.add_argument("--out", default=None, help="JSON file for rank 0's epoch times")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # like a 1-CPU Ray worker
    # torchrun sets MASTER_ADDR/PORT, RANK and WORLD_SIZE: the env:// defaults.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data_cfg = DataConfig(name="synthetic_wind", params=json.loads(args.data_params))
    if rank == 0:  # generate the dataset once; the others then read the cache
        prepare_data(data_cfg, Path(args.data_dir), SEED)
    dist.barrier()
    data_ref = prepare_data(data_cfg, Path(args.data_dir), SEED)
    splits = build_data(data_ref, SEED)
    model_cfg = ModelConfig(
        **({"target": args.model_target} if args.model_target else {"name": "wind_transformer"}),
        params=json.loads(args.model_params),
    )
    torch.manual_seed(SEED)
    spec = build_model(model_factory(model_cfg), dict(splits.info))
    model = DistributedDataParallel(spec.module)

    micro_batch = args.global_batch // world
    steps = len(splits.train) // args.global_batch
    sampler = DistributedSampler(
        splits.train, num_replicas=world, rank=rank, shuffle=True, seed=SEED
    )
    loader = DataLoader(splits.train, batch_size=micro_batch, sampler=sampler, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = steps * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, 0, total, 0.0)
    )
    torch.manual_seed(SEED + 1 + rank)

    epoch_times = []
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        batches = iter(loader)
        for _ in range(steps):
            out = spec.step(model, next(batches))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        epoch_times.append(time.perf_counter() - start)
    if rank == 0 and args.out:
        Path(args.out).write_text(
            json.dumps({"epoch_time_s": epoch_times, "steps_per_epoch": steps, "world": world})
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # Out without the interpreter's shutdown: DDP still holds the gloo process group, whose
    # loop thread frees the last all-reduce's work (and a Python object with it) after the
    # step has moved on; where that comes once shutdown began, taking the GIL ends the
    # thread inside a C++ destructor and the rank aborts (SIGABRT, "terminate called
    # without an active exception": 6 of 25 runs of the first-step benchmark's baseline).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
