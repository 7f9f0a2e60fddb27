"""Streaming Parquet data from an object store: data wait and throughput against Ray Data.

The quickstart's synthetic wind Parquet (the suite's data, ``workload.py``) is put on the S3
test server (``raytrain_app.testing.s3_server``: moto, over HTTP on loopback) and prepared
once with ``data.streaming``'s prepare pass (Ray Data, cache also in the bucket); that pass
is timed on its own and reported, not counted in either figure. Then, in one invocation:

1. Data wait: the share of step time spent waiting for the next batch when raytrain's
   streaming loader (``StreamBatches`` over the prepared files in the bucket, 1 rank)
   feeds the step, measured as ``data_wait`` measures the in-memory loader: steps with a
   streamed batch alternate with steps on one repeated batch, on one model, and
   share = (streamed step - repeated step) / streamed step. The model is the suite's
   (the wind transformer, as in ``data_wait``). The figure is the share with every block
   read from the store (``copy_held`` off): this data fits in one block of the 64 lanes,
   so by default every epoch after the first copies its row groups from the block before
   and reads nothing from S3, which data bigger than a node would not. The default's
   share, and the share with the small model of part 2 (about a millisecond a step), are
   recorded alongside, with the bytes each read from the store a round. Goal: <= 5 %.
2. Samples/s: ``raytrain_app.train`` streaming the bucket (``data.path`` and
   ``data.cache_dir`` both ``s3://``) vs a hand-written Ray Train loop
   (``benchmarks/ray_data_loop.py``: ``get_dataset_shard("train").iter_torch_batches``
   over a Ray Dataset of the same training windows, written once to Parquet in the same
   bucket), same small model (``benchmarks/window_model.py``), global batch, workers and
   steps; epochs after the first, interleaved A B A B, median of the repeats.
   Goal: raytrain / hand-written >= 0.95.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import raytrain_app
from benchmarks import ray_data_loop
from benchmarks.common import interleave, median, ratio_record, unique_name
from benchmarks.context import Context
from benchmarks.data_wait import GOAL_PERCENT, AlternatingTrainer
from benchmarks.plain_loop import intra_op_threads
from benchmarks.window_model import HIDDEN
from benchmarks.window_model import build_model as build_small_model
from benchmarks.workload import GLOBAL_BATCH, LR, SEED, WEIGHT_DECAY, Workload, train_config
from benchmarks.workload import epoch_rows as run_epoch_rows
from raytrain_app.config import config_from_dict
from raytrain_app.data.stream_prepare import PreparedStream, prepare_stream
from raytrain_app.data.stream_reader import PreparedFiles, read_windows
from raytrain_app.planning.environment import detect_environment
from raytrain_app.planning.rules import make_plan
from raytrain_app.protocol import ModelSpec
from raytrain_app.storage import StorageLocation
from raytrain_app.testing.s3_server import CREDENTIALS, S3Server, s3_for_this_process
from raytrain_app.worker.stream_batches import StreamBatches

logger = logging.getLogger(__name__)

BUCKET = "bench-stream"
THROUGHPUT_GOAL = 0.95
SMALL_MODEL = {"hidden": HIDDEN}
WINDOW_FILES = 8  # Parquet files of the hand-written loop's windows


def epochs(ctx: Context) -> int:
    """Epochs per throughput run: the first is the warm-up, the rest are measured."""
    return 2 if ctx.settings.quick else 4


def worker_counts() -> list[int]:
    return [1, 2]


@dataclass
class Bucket:
    """The data, its prepared store and the hand-written loop's windows on the S3 server."""

    s3: S3Server
    data_uri: str
    cache_uri: str
    params: dict[str, Any]
    prepared: PreparedStream
    prepare_s: float
    windows_uri: str
    windows_s: float

    def files(self) -> PreparedFiles:
        return PreparedFiles(self.prepared.manifest, self.prepared.location)

    @property
    def info(self) -> dict[str, Any]:
        return dict(self.prepared.manifest.info())

    def arrow_filesystem(self) -> Any:
        """The server as a pyarrow filesystem with its settings spelled out (picklable for
        Ray Data's read tasks, which do not see this process's AWS_* variables)."""
        from pyarrow import fs

        host = self.s3.endpoint_url.removeprefix("http://")
        return fs.S3FileSystem(
            access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region=CREDENTIALS["AWS_DEFAULT_REGION"],
            endpoint_override=host,
            scheme="http",
        )


def fill_bucket(s3: S3Server, workload: Workload) -> Bucket:
    """Upload the Parquet data, run the prepare pass (timed), write the baseline's windows."""
    local = Path(workload.data.params["path"])
    data_uri = s3.uri("data", local.name)
    StorageLocation.parse(data_uri, "benchmark data").upload(local)
    params = {k: v for k, v in workload.data.params.items() if k != "path"}
    cache_uri = s3.uri("cache")
    start = time.perf_counter()
    prepared = prepare_stream(data_uri, params, cache_uri)
    prepare_s = time.perf_counter() - start
    logger.info("  prepare pass: %.1f s (%s)", prepare_s, prepared.location)
    bucket = Bucket(s3, data_uri, cache_uri, params, prepared, prepare_s, "", 0.0)
    start = time.perf_counter()
    bucket.windows_uri = write_windows(bucket)
    bucket.windows_s = time.perf_counter() - start
    return bucket


def write_windows(bucket: Bucket) -> str:
    """Every training window of the prepared store (standardised, as raytrain streams them)
    as Parquet rows in the bucket: ``x`` and ``y`` Ray tensor columns."""
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    files = bucket.files()
    count = files.manifest.chunks("train").num_windows
    x, y = read_windows(files, "train", np.arange(count, dtype=np.int64)).gather(slice(None))
    table = pa.table(
        {"x": ArrowTensorArray.from_numpy(x.numpy()), "y": ArrowTensorArray.from_numpy(y.numpy())}
    )
    path = f"{bucket.s3.bucket}/windows"
    ray.data.from_arrow(table).repartition(WINDOW_FILES).write_parquet(
        path, filesystem=bucket.arrow_filesystem()
    )
    return path


# -- 1. data wait --------------------------------------------------------------------------


def one_rank_plan() -> Any:
    """The plan of a 1-worker CPU run at the suite's global batch (as ``data_wait``)."""
    cfg = config_from_dict(train_config("bench", Path("."), workers=1, epochs=1, data={}))
    return replace(make_plan(cfg, detect_environment()), dataloader_workers=0)


class StreamingAlternatingTrainer(AlternatingTrainer):
    """``data_wait``'s alternating trainer with raytrain's streaming loader for 1 rank;
    ``copy_held`` as ``StreamBatches.copy_held``."""

    def __init__(self, files: PreparedFiles, spec: ModelSpec, copy_held: bool = True) -> None:
        self.loaders = StreamBatches(
            files, one_rank_plan(), seed=SEED, rank=0, world_size=1, prepare=lambda x: x
        )
        self.loaders.copy_held = copy_held
        self.steps_per_epoch = self.loaders.steps_per_epoch
        self.mock_batch = next(iter(self.loaders.epoch_batches(0)))
        self.spec, self.model = spec, spec.module
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY
        )
        self.epoch = 0
        self.batches = iter(())


def wait_trainers(ctx: Context, bucket: Bucket) -> dict[str, StreamingAlternatingTrainer]:
    """The suite's model with every block read from the store (the figure) and by default,
    and the small model by default; each its own model, seeded as raytrain seeds."""
    with intra_op_threads(1):
        trainers = {}
        for name, copy_held in (("suite_model_every_block_read", False), ("suite_model", True)):
            _, spec = ctx.workload().build()  # raytrain's seeding: the data_wait model
            trainers[name] = StreamingAlternatingTrainer(bucket.files(), spec, copy_held)
        torch.manual_seed(SEED)
        small_spec = build_small_model(SMALL_MODEL, bucket.info)
        trainers["small_model"] = StreamingAlternatingTrainer(bucket.files(), small_spec)
    return trainers


def wait_round(trainer: StreamingAlternatingTrainer) -> dict[str, float]:
    """One epoch's worth of each kind of step (the epoch's first reads included), and the
    bytes read from the store meanwhile (reads ahead finishing later count in the next)."""
    files = trainer.loaders.files
    before = files.bytes_read
    result = trainer.run(trainer.steps_per_epoch)
    return {**result, "store_bytes": files.bytes_read - before}


def data_wait(ctx: Context, bucket: Bucket) -> dict[str, Any]:
    """Part 1: the streaming loader's wait share, with the suite's model and the small one."""
    trainers = wait_trainers(ctx, bucket)
    results = interleave(
        {name: (lambda i, t=t: wait_round(t)) for name, t in trainers.items()},
        ctx.settings.repeats,
        warmup_rounds=1,
    )
    for trainer in trainers.values():
        trainer.loaders.shut_down()
    summary = {}
    for name, runs in results.items():
        real = median([r["real_s_per_step"] for r in runs])
        summary[name] = {
            "share_percent": round(median([r["share_percent"] for r in runs]), 2),
            "next_share_percent": round(
                median([100.0 * r["next_s_per_step"] / r["real_s_per_step"] for r in runs]), 2
            ),
            "streamed_s_per_step": round(real, 6),
            "repeated_s_per_step": round(median([r["mock_s_per_step"] for r in runs]), 6),
            "steps_per_round": trainers[name].steps_per_epoch,
            "store_mib_per_round": round(median([r["store_bytes"] for r in runs]) / 2**20, 2),
        }
    return {"summary": summary, "raw": results}


# -- 2. samples/s --------------------------------------------------------------------------


def raytrain_config(ctx: Context, bucket: Bucket, workers: int, round_index: int) -> dict:
    return {
        "experiment": {
            "name": unique_name("stream", workers, round_index),
            "output_dir": str(ctx.runs_dir),
            "seed": SEED,
        },
        "model": {"target": "benchmarks.window_model:build_model", "params": SMALL_MODEL},
        "data": {
            "path": bucket.data_uri,
            "streaming": True,
            "cache_dir": bucket.cache_uri,
            "params": bucket.params,
        },
        "train": {"epochs": epochs(ctx), "global_batch_size": GLOBAL_BATCH, "lr": LR},
        "scaling": {"num_workers": workers, "use_gpu": False},
    }


def throughput(steps: list[int], times: list[float]) -> float:
    return sum(steps) * GLOBAL_BATCH / sum(times)


def raytrain_run(ctx: Context, bucket: Bucket, workers: int, round_index: int) -> dict:
    """``raytrain_app.train`` streaming from the bucket; epochs after the first."""
    result = raytrain_app.train(raytrain_config(ctx, bucket, workers, round_index), progress=False)
    rows = run_epoch_rows(result.run_dir)
    steps, times = [int(r["steps"]) for r in rows], [r["epoch_time_s"] for r in rows]
    return {
        "samples_per_s": throughput(steps[1:], times[1:]),
        "steps_per_epoch": steps[-1],
        "epoch_time_s": [round(t, 4) for t in times],
    }


def handwritten_run(ctx: Context, bucket: Bucket, workers: int, round_index: int) -> dict:
    """The hand-written TorchTrainer over a Ray Dataset of the windows in the bucket."""
    import ray.data

    dataset = ray.data.read_parquet(bucket.windows_uri, filesystem=bucket.arrow_filesystem())
    done = ray_data_loop.fit(
        dataset,
        workers=workers,
        epochs=epochs(ctx),
        info=bucket.info,
        model_params=SMALL_MODEL,
        scratch=ctx.settings.scratch("ray-data-loop"),
        name=unique_name("ray-data-loop", workers, round_index),
    )
    steps, times = done["steps"], done["epoch_time_s"]
    return {
        "samples_per_s": throughput(steps[1:], times[1:]),
        "steps_per_epoch": steps[-1],
        "epoch_time_s": [round(t, 4) for t in times],
    }


def samples_per_s(ctx: Context, bucket: Bucket) -> dict[str, list[dict[str, Any]]]:
    variants = {}
    for n in worker_counts():
        variants[f"raytrain_{n}w"] = lambda i, n=n: raytrain_run(ctx, bucket, n, i)
        variants[f"handwritten_{n}w"] = lambda i, n=n: handwritten_run(ctx, bucket, n, i)
    return interleave(variants, ctx.settings.repeats)


def throughput_ratio(runs: dict[str, list[dict[str, Any]]], workers: int) -> dict[str, Any]:
    """raytrain / hand-written samples/s at ``workers`` workers (``common.ratio_record``)."""
    names = [f"raytrain_{workers}w", f"handwritten_{workers}w"]
    return ratio_record(
        candidate=names[0],
        baseline=names[1],
        samples={k: [r["samples_per_s"] for r in runs[k]] for k in names},
        goal=THROUGHPUT_GOAL,
        higher_is_better=True,
        unit="samples/s",
        what=f"samples/s at {workers} worker(s), epochs after the first",
        steps_per_epoch={k: runs[k][0]["steps_per_epoch"] for k in names},
        epoch_time_s={k: [r["epoch_time_s"] for r in runs[k]] for k in names},
    )


# -- the record ----------------------------------------------------------------------------


# The AWS SDK inside pyarrow may send an upload as ``aws-chunked`` with a trailing checksum
# (its default, ``when_supported``); moto's server stores such a body with the chunk framing
# in it, so files written by the prepare pass's Ray Data tasks became unreadable ("Parquet
# magic bytes not found"). Real S3 decodes it. Ray's workers inherit the variable from the
# process that starts Ray, so Ray is (re)started with it.
TEST_SERVER_ENV = {"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required"}


def start_ray_for_test_server(ctx: Context) -> None:
    """This invocation's Ray, started with ``TEST_SERVER_ENV`` (restarted if it was not)."""
    missing = {k: v for k, v in TEST_SERVER_ENV.items() if os.environ.get(k) != v}
    if missing:
        ctx.local_ray.shutdown()
        os.environ.update(missing)
    ctx.local_ray.ensure()


def run(ctx: Context) -> dict[str, Any]:
    workload = ctx.workload()
    start_ray_for_test_server(ctx)
    scratch = ctx.settings.scratch("streaming")
    with s3_for_this_process(BUCKET, log_path=scratch / "moto.log") as s3:
        bucket = fill_bucket(s3, workload)
        wait = data_wait(ctx, bucket)
        runs = samples_per_s(ctx, bucket)
    share = wait["summary"]["suite_model_every_block_read"]["share_percent"]
    default = wait["summary"]["suite_model"]["share_percent"]
    small = wait["summary"]["small_model"]["share_percent"]
    ratios = {n: throughput_ratio(runs, n) for n in worker_counts()}
    worst = min(r["ratio"] for r in ratios.values())
    manifest = bucket.prepared.manifest
    return {
        "what": (
            f"streaming from the S3 test server (data and cache s3://), global batch "
            f"{GLOBAL_BATCH}: share of step time waiting for the batch (StreamBatches, 1 rank, "
            f"the suite's model, every block read from S3; alternating with a repeated batch "
            f"as data_wait), and "
            f"samples/s of raytrain_app.train vs a hand-written TorchTrainer over "
            f"iter_torch_batches on the same windows, small model, epochs 2..{epochs(ctx)}"
        ),
        "figure": share,
        "figure_unit": "%",
        "secondary": (
            f"default (row groups the block before holds copied) {default:.1f} %; "
            f"small model {small:.1f} %; samples/s raytrain / hand-written "
            + ", ".join(f"{n}w {ratios[n]['ratio']:.3f}" for n in ratios)
            + f"; prepare pass {bucket.prepare_s:.1f} s"
        ),
        "goal": f"<= {GOAL_PERCENT} % wait; >= {THROUGHPUT_GOAL} samples/s ratio",
        "goal_met": share <= GOAL_PERCENT and worst >= THROUGHPUT_GOAL,
        "data_wait": {
            "goal": f"<= {GOAL_PERCENT} %",
            "goal_met": share <= GOAL_PERCENT,
            **wait["summary"],
        },
        "samples_per_s": {f"{n}_workers": ratios[n] for n in ratios},
        "samples_per_s_goal_met": worst >= THROUGHPUT_GOAL,
        "prepare_pass_s": round(bucket.prepare_s, 2),
        "prepare_reused": bucket.prepared.reused,
        "baseline_windows_write_s": round(bucket.windows_s, 2),
        "data": {
            "series": len(manifest.series),
            "train_windows": manifest.chunks("train").num_windows,
            "val_windows": manifest.chunks("val").num_windows,
            "rows_per_group": manifest.rows_per_group,
            "params": bucket.params,
        },
        "raw": {"data_wait": wait["raw"], "samples_per_s": runs},
    }
