"""A data factory's Ray Datasets (``RayDataSplits``), readied once on the driver.

The factory runs here, after Ray is connected, instead of in every worker: Ray Datasets
are handles to a pipeline that Ray Train splits over the workers, so building them once
is both cheaper and the only way every worker reads the same split. What the workers need
besides their shards (row counts, ``to_batch``, ``info``) travels in a ``RayDataPlan``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

from raytrain_app.errors import BadInputError
from raytrain_app.protocol import DataSplits, RayDataSplits, ray_data_refusal
from raytrain_app.worker.ray_dataset_batches import TRAIN, VAL, RayDataPlan
from raytrain_app.workloads import FactoryRef, build_data, import_target

logger = logging.getLogger(__name__)

# Training rows taken on the driver for the checks that index samples (the monitor check
# here, the memory probe in workers, which repeats them up to its batch size).
_SAMPLE_ROWS = 8

_COMMANDS = {
    "train": None,
    "local": "raytrain train --local (no Ray Train workers to hand dataset shards to)",
    "tune": "raytrain tune (each trial loads its data itself)",
    "predict": "raytrain predict (it runs without Ray)",
}


@dataclass
class RayDataInputs:
    """What the trainer and the workers get for ``RayDataSplits``.

    Attributes:
        datasets: ``TorchTrainer(datasets=...)``.
        dataset_config: ``TorchTrainer(dataset_config=...)``.
        plan: for ``WorkerTask``; its ``splits()`` stand in for the map-style splits in the
            driver's checks (``info``, the monitor check on a few rows).
    """

    datasets: dict[str, Any]
    dataset_config: Any
    plan: RayDataPlan


def load_data_splits(
    ref: FactoryRef, seed: int, global_batch_size: int, command: str = "train"
) -> Any:
    """Call the data factory once on the driver: what ``workloads.build_data`` returns
    (``DataSplits``, or raytrain's streaming splits for ``data.path``) as it is, or a
    user factory's ``RayDataSplits`` checked, counted and readied for Ray Train.

    Args:
        command: who asks: ``train`` uses Ray Datasets; ``local``, ``tune`` and
            ``predict`` refuse them with one line.

    Raises:
        BadInputError: the factory returned something else, Ray Datasets where the command
            cannot use them, or too few training rows for one global batch.
    """
    if command not in _COMMANDS:
        raise ValueError(f"command must be one of {', '.join(_COMMANDS)}, not {command!r}")
    if ref.config_key != "data.target":  # built-in data and data.path: never Ray Datasets
        return build_data(ref, seed)
    splits = import_target(ref.target, ref.config_key)(dict(ref.params), seed)
    if isinstance(splits, DataSplits):
        return splits
    if not isinstance(splits, RayDataSplits):
        raise BadInputError(
            f"{ref.config_key}={ref.target!r} returned {type(splits).__name__}, not "
            f"raytrain_app.DataSplits or RayDataSplits; see docs/users/own-model-and-data.md"
        )
    if _COMMANDS.get(command):
        raise BadInputError(ray_data_refusal(ref.config_key, ref.target, _COMMANDS[command]))
    return ray_data_inputs(splits, ref, global_batch_size)


def ray_data_inputs(
    splits: RayDataSplits, ref: FactoryRef, global_batch_size: int
) -> RayDataInputs:
    """Check ``splits``, count their rows and make Ray Train's dataset config."""
    import ray.data

    where = f"{ref.config_key}={ref.target!r}"
    if not callable(splits.to_batch):
        raise BadInputError(
            f"{where} returned RayDataSplits whose to_batch is not callable; pass a "
            f"module-level function from a batch of rows to the step's batch"
        )
    for name in (TRAIN, VAL):
        dataset = getattr(splits, name)
        if not isinstance(dataset, ray.data.Dataset):
            raise BadInputError(
                f"{where} returned RayDataSplits whose {name} is {type(dataset).__name__}, "
                f"not a ray.data.Dataset; return DataSplits for torch datasets"
            )
    # A full run of the pipeline unless Ray knows the count from metadata (a materialized
    # dataset, a plain Parquet read): the only way to know the steps per epoch up front.
    train_rows, val_rows = splits.train.count(), splits.val.count()
    steps = train_rows // global_batch_size
    if steps == 0:
        raise BadInputError(
            f"{where} returned {train_rows} training rows, fewer than one global batch "
            f"(train.global_batch_size={global_batch_size}); give more rows or lower "
            f"train.global_batch_size"
        )
    plan = RayDataPlan(
        train_rows=train_rows,
        val_rows=val_rows,
        steps_per_epoch=steps,
        to_batch=splits.to_batch,
        info=dict(splits.info),
        sample=splits.train.take_batch(min(_SAMPLE_ROWS, train_rows), batch_format="numpy"),
    )
    logger.info(
        "Ray Datasets: %d train rows (%d steps per epoch), %d val rows",
        train_rows,
        steps,
        val_rows,
    )
    return RayDataInputs({TRAIN: splits.train, VAL: splits.val}, dataset_config(), plan)


def dataset_config() -> Any:
    """Ray Train's ``DataConfig`` for ``RayDataSplits``.

    Only ``train`` is split (``streaming_split(equal=True)``: equal row counts, so equal
    step counts). ``val`` is read whole by every rank, which keeps every rank's batch
    ``j`` the same batch; that needs ``preserve_order``. The training split keeps its order
    too and ignores locality (Ray turns locality off under ``preserve_order`` anyway): then
    a deterministic pipeline splits the same way each time at one world size.
    """
    import ray.train
    from ray.data.context import DataContext

    options = {}
    for name in (TRAIN, VAL):
        # This driver's Ray Data options (what Ray Train would use), with the order kept.
        options[name] = copy.deepcopy(DataContext.get_current().execution_options)
        options[name].preserve_order = True
    return ray.train.DataConfig(
        datasets_to_split=[TRAIN], execution_options=options, enable_shard_locality=False
    )
