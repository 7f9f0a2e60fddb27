"""Single-device inference from a checkpoint: ``raytrain predict``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

from raytrain_app.checkpoint.loading import load_model_spec
from raytrain_app.errors import BadInputError
from raytrain_app.workloads import FactoryRef, build_data

_PARQUET_FACTORY = "raytrain_app.data.parquet_windows:build"


def _input_data(meta: dict, input_path: str | None) -> FactoryRef:
    ref = FactoryRef(**meta["data_factory"])
    if input_path is None:
        return ref
    if ref.target != _PARQUET_FACTORY:
        raise BadInputError(
            "--input needs a model trained on Parquet data (data.name: synthetic_wind or "
            "data.path); this checkpoint's data is not Parquet, so predict on its validation "
            "set instead (leave out --input)"
        )
    if not Path(input_path).exists():
        raise BadInputError(f"--input '{input_path}' does not exist; pass a Parquet file")
    return replace(ref, params={**ref.params, "path": input_path})


def _columns(values: np.ndarray) -> np.ndarray:
    """``[N]`` (one output per sample, e.g. a class) as ``[N, 1]``; ``[N, K]`` unchanged."""
    return values[:, None] if values.ndim == 1 else values


def predict(
    checkpoint: str | Path,
    input_path: str | None = None,
    output_path: str | Path = "predictions.parquet",
    batch_size: int = 256,
) -> Path:
    """Predict the validation windows of the training data (or of ``input_path``).

    Writes a Parquet table with one row per sample: ``pred_<k>`` and ``true_<k>`` for each
    output ``k`` (a forecaster's horizon steps, in the data's original units; a classifier's
    one predicted class and label). Batches are made by the data's ``collate`` if it has
    one, and their targets are ``batch[1]``. Returns the output path.
    """
    if input_path is not None and Path(input_path).resolve() == Path(output_path).resolve():
        raise BadInputError(
            f"--output '{output_path}' is the --input file and would overwrite it; write the "
            f"predictions to another file"
        )
    spec, meta = load_model_spec(checkpoint)
    ref = _input_data(meta, input_path)
    if ref.target == _PARQUET_FACTORY:
        # Inputs are standardised with the training statistics, never the new file's own.
        ref = replace(ref, params={**ref.params, "stats": meta["data_info"]})
    # The run's seed: generated data (synthetic images) is then the run's validation set.
    splits = build_data(ref, meta.get("config", {}).get("experiment", {}).get("seed", 0))
    predict_fn = spec.predict or (lambda m, batch: m(batch[0]))
    predictions, truths = [], []
    with torch.no_grad():
        for batch in DataLoader(splits.val, batch_size, collate_fn=splits.batch_collate()):
            predictions.append(predict_fn(spec.module, batch).numpy())
            truths.append(batch[1].numpy())
    pred = _columns(np.concatenate(predictions))
    info = meta["data_info"]
    true = _columns(np.concatenate(truths))
    if "target_std" in info or "target_mean" in info:  # standardised regression targets
        true = true * info.get("target_std", 1.0) + info.get("target_mean", 0.0)
    columns = {f"pred_{k}": pred[:, k] for k in range(pred.shape[1])}
    columns.update({f"true_{k}": true[:, k] for k in range(true.shape[1])})
    output = Path(output_path)
    pq.write_table(pa.table(columns), output)
    return output
