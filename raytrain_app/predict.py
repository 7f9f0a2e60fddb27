"""Single-device inference from a checkpoint: ``raytrain predict``."""

from __future__ import annotations

import fnmatch
import glob
import os
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

from raytrain_app.checkpoint.loading import LoadedModel, load_model_spec
from raytrain_app.checkpoint.trust import CodeTrust, checked_factory
from raytrain_app.config import RaytrainConfig
from raytrain_app.data.parquet_source import resolve_paths
from raytrain_app.data.stream_manifest import ScalingStats
from raytrain_app.data.stream_prepare import prepare_stream
from raytrain_app.data.stream_reader import PreparedFiles, load_manifest, window_batches
from raytrain_app.data.stream_windows import FACTORY as STREAM_FACTORY
from raytrain_app.errors import BadInputError
from raytrain_app.storage import is_uri
from raytrain_app.workloads import FactoryRef, build_data

_PARQUET_FACTORY = "raytrain_app.data.parquet_windows:build"


def _input_data(data_ref: FactoryRef, input_path: str | None) -> FactoryRef:
    if input_path is None:
        return data_ref
    if data_ref.target != _PARQUET_FACTORY:
        raise BadInputError(
            "--input needs a model trained on Parquet data (data.name: synthetic_wind or "
            "data.path); this checkpoint's data is not Parquet, so predict on its validation "
            "set instead (leave out --input)"
        )
    if not is_uri(input_path) and not Path(input_path).exists():
        raise BadInputError(f"--input '{input_path}' does not exist; pass a Parquet file")
    return replace(data_ref, params={**data_ref.params, "path": input_path})


def check_output(output_path: str | Path) -> Path:
    """``--output`` as a file that can be written: its folder exists, it is no folder.

    Checked before the model is loaded or any prediction computed.
    """
    output = Path(output_path).expanduser()
    if output.is_dir():
        raise BadInputError(f"--output '{output_path}' is a folder; name a .parquet file")
    if not output.parent.is_dir():
        raise BadInputError(
            f"--output '{output_path}': the folder '{output.parent}' does not exist; create "
            f"it or write the predictions elsewhere"
        )
    return output


def refuse_overwriting_data(output: Path, data_ref: FactoryRef, from_input: bool) -> None:
    """Refuse an ``--output`` that is the Parquet data predictions are made from, however it
    is spelled (relative, through a link, by another name of the file), or that would join
    it (a file in a data folder, or one a data glob matches).

    ``from_input``: the data is ``--input``'s (else the data the checkpoint trained on).
    """
    path = data_ref.params.get("path") if data_ref.target == _PARQUET_FACTORY else None
    if path is None:
        return
    given = [path] if isinstance(path, str) else list(path)
    local = [p for p in given if isinstance(p, str) and not is_uri(p)]
    target = output.resolve()
    folders = [Path(p).expanduser().resolve() for p in local if Path(p).expanduser().is_dir()]
    files = [f for f in resolve_paths(local) if isinstance(f, Path)] if local else []
    patterns = [str(Path(p).expanduser().absolute()) for p in local if glob.has_magic(p)]
    same_file = output.exists() and any(os.path.samefile(output, f) for f in files)
    if not (
        same_file
        or target in {f.resolve() for f in files}
        or any(target.is_relative_to(folder) for folder in folders)
        or any(fnmatch.fnmatch(str(output.absolute()), p) for p in patterns)
    ):
        return
    data = "the --input file" if from_input else f"the data the checkpoint trained on ({path})"
    raise BadInputError(
        f"--output '{output}' is {data} (or would become part of it) and would overwrite "
        f"it; write the predictions to another file"
    )


def _columns(values: np.ndarray) -> np.ndarray:
    """``[N]`` (one output per sample, e.g. a class) as ``[N, 1]``; ``[N, K]`` unchanged."""
    return values[:, None] if values.ndim == 1 else values


def predict(
    checkpoint: str | Path,
    input_path: str | None = None,
    output_path: str | Path = "predictions.parquet",
    batch_size: int = 256,
    *,
    trust_code: bool = False,
    config: RaytrainConfig | dict | str | Path | None = None,
) -> Path:
    """Predict the validation windows of the training data (or of ``input_path``).

    Writes a Parquet table with one row per sample: ``pred_<k>`` and ``true_<k>`` for each
    output ``k`` (a forecaster's horizon steps, in the data's original units; a classifier's
    one predicted class and label). Batches are made by the data's ``collate`` if it has
    one, and their targets are ``batch[1]``. Returns the output path. ``trust_code`` and
    ``config``: which factories the checkpoint names may be called (``load_model``).
    """
    output = check_output(output_path)
    trust = CodeTrust.from_config(config, trust_code)
    loaded = load_model_spec(checkpoint, trust=trust)
    data_ref = checked_factory(loaded.data_factory, trust, loaded.meta_file, loaded.run_root)
    if data_ref.target == STREAM_FACTORY:  # trained on streaming data: predict streams too
        return _predict_streaming(loaded, data_ref, input_path, output, batch_size)
    ref = _input_data(data_ref, input_path)
    refuse_overwriting_data(output, ref, from_input=input_path is not None)
    spec, meta = loaded.spec, loaded.meta
    if ref.target == _PARQUET_FACTORY:
        # Inputs are standardised with the training statistics, never the new file's own.
        ref = replace(ref, params={**ref.params, "stats": meta["data_info"]})
    # The run's seed: generated data (synthetic images) is then the run's validation set.
    splits = build_data(ref, _seed(meta))
    predict_fn = spec.predict or (lambda m, batch: m(batch[0]))
    predictions, truths = [], []
    with torch.no_grad():
        for batch in DataLoader(splits.val, batch_size, collate_fn=splits.batch_collate()):
            _refuse_mappings(batch, ref)
            predictions.append(predict_fn(spec.module, batch).numpy())
            truths.append(batch[1].numpy())
    columns = _prediction_columns(
        np.concatenate(predictions), np.concatenate(truths), meta["data_info"]
    )
    pq.write_table(pa.table(columns), output)
    return output


def _refuse_mappings(batch: Any, data_ref: FactoryRef) -> None:
    """Refuse a batch that is a Mapping (a Hugging Face model's ``input_ids``/``labels``):
    predict writes a row per sample from ``(inputs, targets)``."""
    if isinstance(batch, Mapping):
        raise BadInputError(
            f"raytrain predict writes a row per sample from (inputs, targets) batches, and "
            f"{data_ref.target!r} gives {type(batch).__name__} batches (keys "
            f"{', '.join(map(str, batch))}); load the model with load_model (or, a Hugging "
            f"Face model, raytrain export) and predict in your own code"
        )


def _prediction_columns(pred: np.ndarray, true: np.ndarray, info: dict) -> dict:
    """``pred_<k>`` and ``true_<k>`` columns, the truths in the target's own units."""
    pred, true = _columns(pred), _columns(true)
    if "target_std" in info or "target_mean" in info:  # standardised regression targets
        true = true * info.get("target_std", 1.0) + info.get("target_mean", 0.0)
    columns = {f"pred_{k}": pred[:, k] for k in range(pred.shape[1])}
    columns.update({f"true_{k}": true[:, k] for k in range(true.shape[1])})
    return columns


def _predict_streaming(
    loaded: LoadedModel,
    data_ref: FactoryRef,
    input_path: str | None,
    output: Path,
    batch_size: int,
) -> Path:
    """The validation windows of the run's prepared data, or of ``--input`` prepared
    with the run's window params, predicted batch by batch and written as they come.

    ``--input`` is prepared in this process (no cluster): one pass holding the input's
    columns, into a folder beside ``output`` that is removed afterwards. Both are scaled
    with the training statistics."""
    info = loaded.meta["data_info"]
    with tempfile.TemporaryDirectory(prefix=".raytrain-predict-", dir=output.parent) as scratch:
        if input_path is None:
            folder = data_ref.params["folder"]
        else:
            if not is_uri(input_path) and not Path(input_path).exists():
                raise BadInputError(f"--input '{input_path}' does not exist; pass a Parquet file")
            input_ref = FactoryRef(_PARQUET_FACTORY, {"path": input_path}, "--input")
            refuse_overwriting_data(output, input_ref, from_input=True)
            folder = prepare_stream(input_path, _window_params(loaded.meta), scratch).location
        manifest = load_manifest(folder)
        if input_path is not None:  # the new data is scaled as the training data was
            stats = ScalingStats(**{key: info[key] for key in ScalingStats.model_fields})
            manifest = manifest.model_copy(update={"stats": stats})
        files = PreparedFiles(manifest, folder)
        with ThreadPoolExecutor(1, thread_name_prefix="raytrain-predict") as read_ahead:
            batches = window_batches(files, "val", batch_size, read_ahead)
            _write_predictions(loaded.spec, batches, info, output)
    return output


def _write_predictions(spec: Any, batches: Iterator[Any], info: dict, output: Path) -> None:
    """Predictions and truths (in the target's units) of ``batches``, appended per batch."""
    predict_fn = spec.predict or (lambda m, batch: m(batch[0]))
    writer = None
    try:
        with torch.no_grad():
            for batch in batches:
                pred = predict_fn(spec.module, batch).numpy()
                table = pa.table(_prediction_columns(pred, batch[1].numpy(), info))
                writer = writer or pq.ParquetWriter(output, table.schema)
                writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()


def _window_params(meta: dict) -> dict:
    """The run's ``data.params`` (its window and column params), from meta.json's config."""
    data = (meta.get("config") or {}).get("data") or {}
    params = data.get("params") if isinstance(data, dict) else None
    if not isinstance(params, dict):
        raise BadInputError(
            "meta.json's config has no data.params; use a checkpoint written by raytrain"
        )
    return params


def _seed(meta: dict) -> int:
    """The run's ``experiment.seed`` from meta.json's resolved config (0 if absent)."""
    config = meta.get("config")
    experiment = config.get("experiment") if isinstance(config, dict) else None
    seed = experiment.get("seed", 0) if isinstance(experiment, dict) else 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadInputError(
            f"meta.json's config.experiment.seed is {seed!r}, not an integer; it was edited: "
            f"use a checkpoint written by raytrain"
        )
    return seed
