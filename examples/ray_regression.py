"""Ray's own regression example (``ray/train/examples/pytorch/torch_regression_example.py``)
on raytrain: the data factory returns Ray Datasets.

Train it with::

    PYTHONPATH=examples raytrain train --config examples/ray_regression.yaml

As in Ray's example, a CSV of 100 feature columns ``x000``..``x099`` and a target ``y``
is read with ``ray.data.read_csv``, the features are packed into one vector column ``x``,
and the rows are shuffled and split 70/30 into training and validation. Ray's file lives in
S3; here it is generated once, deterministically from the seed, into ``params["csv"]``
(no internet needed). raytrain splits the global batch over the workers, accumulates
gradients, validates every row once and checkpoints; ``raytrain_app/protocol.py`` says what
it promises for Ray Datasets (the global batch per step, yes; the same samples for every
number of workers, no).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from raytrain_app import ModelSpec, StepOutput
from raytrain_app.protocol import RayDataSplits

NUM_FEATURES = 100
FEATURES = [f"x{i:03d}" for i in range(NUM_FEATURES)]


def write_csv(path: Path, num_rows: int, noise: float, seed: int) -> Path:
    """A linear target of 100 standard-normal features plus noise, as a CSV; written once
    (the same seed and size give the same file, so an existing one is reused)."""
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, NUM_FEATURES)).astype(np.float32)
    weights = rng.standard_normal(NUM_FEATURES).astype(np.float32) / np.sqrt(NUM_FEATURES)
    y = x @ weights + noise * rng.standard_normal(num_rows).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # a reader never sees half a file
    header = ",".join([*FEATURES, "y"])
    np.savetxt(
        partial, np.column_stack([x, y]), delimiter=",", header=header, comments="", fmt="%.6f"
    )
    partial.rename(path)
    return path


def combine_x(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The example's preprocessing: the 100 feature columns as one vector column ``x``."""
    x = np.stack([batch[name] for name in FEATURES], axis=1).astype(np.float32)
    return {"x": x, "y": batch["y"].astype(np.float32)}


def rows_to_tensors(rows: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of rows as ``(inputs, targets)``: what ``_step`` takes."""
    return torch.as_tensor(rows["x"]), torch.as_tensor(rows["y"]).unsqueeze(1)


def build_data(params: dict, seed: int) -> RayDataSplits:
    """Ray Datasets of the generated CSV: 70% training rows, 30% validation rows.

    Runs once on the driver. The shuffle's seed makes the split the same in every run;
    ``train_test_split`` materializes the shuffled rows in Ray's object store, so training
    reads them from memory instead of re-reading the CSV every epoch.
    """
    import ray.data

    csv = write_csv(
        # Absolute: Ray Data reads it in task processes, which run elsewhere.
        Path(params["csv"]).expanduser().absolute(),
        int(params.get("num_rows", 2048)),
        float(params.get("noise", 0.1)),
        seed,
    )
    dataset = ray.data.read_csv(str(csv)).map_batches(combine_x, batch_format="numpy")
    train, val = dataset.repartition(4).train_test_split(
        float(params.get("val_fraction", 0.3)), shuffle=True, seed=seed
    )
    return RayDataSplits(
        train=train, val=val, to_batch=rows_to_tensors, info={"in_features": NUM_FEATURES}
    )


def _step(module: nn.Module, batch) -> StepOutput:
    x, y = batch
    prediction = module(x)
    return StepOutput(
        loss=nn.functional.mse_loss(prediction, y),
        num_samples=y.shape[0],
        metrics={"mae": (prediction - y).abs().mean()},
    )


def build_model(params: dict, data_info: dict) -> ModelSpec:
    """Ray's example model: one hidden ReLU layer (``hidden`` units, 20 in its run)."""
    hidden = int(params.get("hidden", 20))
    module = nn.Sequential(
        nn.Linear(data_info["in_features"], hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )
    return ModelSpec(module=module, step=_step)
