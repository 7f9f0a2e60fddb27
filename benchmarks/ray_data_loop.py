"""The hand-written Ray Train baseline of the streaming benchmark: the loop a user would write
with Ray Data, on the same windows, model, global batch and number of steps as raytrain.

A ``TorchTrainer`` whose ``train_loop_per_worker`` iterates
``ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=global batch / workers,
drop_last=True)`` over a Ray Dataset read from Parquet in the same object store (one row per
training window: ``x`` ``[context, features + 1]`` and ``y`` ``[horizon]``, already
standardised, as Ray tensor columns), with ``ray.train.torch.prepare_model`` (DDP for more
than one worker), AdamW, grad clip 1.0 and the model's own ``step`` for the loss. Ray's
defaults otherwise: no shuffle, Ray Train's default ``DataConfig``, Ray's worker niceness;
one CPU per worker but one of Ray's CPUs left to Ray Data (``worker_cpus``).
Rank 0 writes each epoch's training time (the first batch's wait included) to a JSON file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import GLOBAL_BATCH, GRAD_CLIP, LR, SEED, WEIGHT_DECAY


def train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker``: ``config`` has ``model_params``, ``info``, ``epochs``,
    ``out`` (rank 0's JSON file)."""
    import ray.train
    import ray.train.torch

    from benchmarks.window_model import build_model

    context = ray.train.get_context()
    world_size = context.get_world_size()
    torch.manual_seed(SEED)
    spec = build_model(config["model_params"], config["info"])
    model = ray.train.torch.prepare_model(spec.module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    shard = ray.train.get_dataset_shard("train")
    times, steps = [], []
    for _ in range(config["epochs"]):
        model.train()
        start, count = time.perf_counter(), 0
        for batch in shard.iter_torch_batches(
            batch_size=GLOBAL_BATCH // world_size, drop_last=True
        ):
            loss = spec.step(model, [batch["x"], batch["y"]]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            count += 1
        times.append(time.perf_counter() - start)
        steps.append(count)
    if context.get_world_rank() == 0:
        Path(config["out"]).write_text(json.dumps({"epoch_time_s": times, "steps": steps}))


def worker_cpus(workers: int) -> float:
    """CPUs each training worker reserves: 1, but leaving one of Ray's CPUs to Ray Data.

    Ray Train gives Ray Data what its workers do not reserve; with every CPU reserved, Ray
    Data's file-listing and read tasks never start and the first batch never comes (2
    workers on a 2-CPU Ray). A user of this loop has to make the same choice.
    """
    import ray

    return min(1.0, max(ray.cluster_resources().get("CPU", 1.0) - 1.0, 0.5) / workers)


def fit(
    dataset: Any,
    *,
    workers: int,
    epochs: int,
    info: dict[str, Any],
    model_params: dict[str, Any],
    scratch: Path,
    name: str,
) -> dict[str, list]:
    """Train with a plain ``TorchTrainer`` on ``dataset``; rank 0's epoch times and steps."""
    import ray.train
    from ray.train.torch import TorchTrainer

    out = scratch / "epochs.json"
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "model_params": model_params,
            "info": info,
            "epochs": epochs,
            "out": str(out),
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers, resources_per_worker={"CPU": worker_cpus(workers)}
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(scratch / "ray_results"),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
        datasets={"train": dataset},
    )
    trainer.fit()
    return json.loads(out.read_text())
