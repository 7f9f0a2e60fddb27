"""Turn the config's model and data sections into importable factories and their params.

Built-in workloads are registered by name and resolve to the same ``"module:attr"`` form a
user's ``target`` has, so workers only ever see a ``FactoryRef``: picklable, importable
anywhere, and identical for built-in and user code.
"""

from __future__ import annotations

import importlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_app.config import DataConfig, ModelConfig, RaytrainConfig
from raytrain_app.data.stream_windows import FACTORY as STREAM_FACTORY
from raytrain_app.data.stream_windows import StreamSplits
from raytrain_app.errors import BadInputError
from raytrain_app.factory_targets import not_importable, split_target
from raytrain_app.protocol import DataSplits, ModelSpec, RayDataSplits, ray_data_refusal
from raytrain_app.storage import StorageLocation, is_uri

BUILTIN_MODELS = {
    "wind_transformer": "raytrain_app.models.wind_transformer:build",
    "resnet_small": "raytrain_app.models.resnet_small:build",
}
BUILTIN_DATA = {
    "synthetic_wind": "raytrain_app.data.parquet_windows:build",
    "synthetic_images": "raytrain_app.data.synthetic_images:build",
}
_PARQUET_FACTORY = "raytrain_app.data.parquet_windows:build"
# The synthetic data fixes its columns (and has no gaps); the windowing and the naive
# baseline's season stay the user's choice.
_SYNTHETIC_WINDOW_PARAMS = ("context_length", "horizon", "val_fraction", "stride", "season_length")


@dataclass(frozen=True)
class FactoryRef:
    """An importable factory and the params it is called with."""

    target: str
    params: dict[str, Any] = field(default_factory=dict)
    config_key: str = "model.target"


def import_target(target: str, config_key: str) -> Any:
    """Import ``"pkg.module:attr"``; a failure names the config key that holds it."""
    module_name, attr = split_target(target, config_key)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise not_importable(target, config_key, str(exc)) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BadInputError(
            f"{config_key}={target!r}: module '{module_name}' has no attribute '{attr}'; "
            f"fix {config_key}"
        ) from None


def _builtin(name: str, registry: dict[str, str], key: str) -> str:
    if name not in registry:
        raise BadInputError(
            f"{key}={name!r} is not a built-in; use one of {', '.join(sorted(registry))} "
            f"or set {key.split('.')[0]}.target to your own factory"
        )
    return registry[name]


def model_factory(model: ModelConfig) -> FactoryRef:
    """The factory that builds the model named by the ``model`` section."""
    if model.target:
        return FactoryRef(model.target, dict(model.params), "model.target")
    return FactoryRef(_builtin(model.name, BUILTIN_MODELS, "model.name"), dict(model.params))


def _check_params(params: dict, allowed: tuple[str, ...], section: str) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise BadInputError(
            f"unknown key '{section}.params.{unknown[0]}'; allowed keys are {', '.join(allowed)}"
        )


def check_sources(model: ModelConfig, data: DataConfig) -> None:
    """Check that the model and data sections name something usable, without building either.

    Imports the factories and reads only the footers of Parquet files, so the driver can run it
    before it uses Ray: a wrong target or path fails before any worker (an embedded Ray begun
    beside the checks is stopped). Building the data and the model (the driver's preflight)
    checks the rest.
    """
    from raytrain_app.data import parquet_windows

    ref = model_factory(model)
    import_target(ref.target, ref.config_key)
    if data.streaming is True and (data.target or data.name == "synthetic_images"):
        source = f"data.target={data.target!r}" if data.target else "data.name=synthetic_images"
        raise BadInputError(
            f"data.streaming=true streams Parquet data (data.path, or data.name=synthetic_wind), "
            f"not {source}; a data factory streams by returning Ray Datasets (RayDataSplits): "
            "set data.streaming to auto or false"
        )
    if data.target:
        import_target(data.target, "data.target")
    elif data.path:
        _check_params(data.params, parquet_windows.WINDOW_PARAMS, "data")
        parquet_windows.check({"path": _data_path(data.path, absolute=False), **data.params})
    else:
        _check_builtin_data(data)


def _check_builtin_data(data: DataConfig) -> None:
    """The built-in dataset exists and takes every key of ``data.params``."""
    from raytrain_app.data import synthetic_images, synthetic_wind

    _builtin(data.name, BUILTIN_DATA, "data.name")
    if data.name == "synthetic_images":
        synthetic_images.check(data.params)
        return
    allowed = synthetic_wind.GENERATOR_PARAMS + _SYNTHETIC_WINDOW_PARAMS
    _check_params(data.params, allowed, "data")


def _data_path(path: str, absolute: bool) -> str:
    """``data.path`` as workers get it: a URI as is, a local path with ``~`` expanded (and
    made absolute: workers may run in another directory)."""
    if is_uri(path):
        return path
    local = Path(path).expanduser()
    return str(local.absolute() if absolute else local)


def prepare_data(
    data: DataConfig,
    data_dir: Path | StorageLocation,
    seed: int,
    task_env: dict[str, str] | None = None,
) -> FactoryRef:
    """Do the driver-side data work once and return what workers call to load the data.

    The synthetic wind dataset is generated here, once, and cached as Parquet in
    ``data_dir`` (a local folder, or the run's ``data/`` in an object store, which workers
    on every node read); workers then read the file like any user Parquet data. The
    synthetic images are generated in memory by every worker (milliseconds), so they need
    nothing here.
    """
    from raytrain_app.data import parquet_windows, synthetic_wind

    if data.target:
        return FactoryRef(data.target, dict(data.params), "data.target")
    if data.path:
        _check_params(data.params, parquet_windows.WINDOW_PARAMS, "data")
        path = _data_path(data.path, absolute=True)
        params = {"path": path, **data.params}
        return _parquet_ref(data, data_dir, params, "data.path", task_env)
    _check_builtin_data(data)
    if data.name != "synthetic_wind":
        return FactoryRef(BUILTIN_DATA[data.name], dict(data.params), "data.name")
    generator = {k: v for k, v in data.params.items() if k in synthetic_wind.GENERATOR_PARAMS}
    windows = {k: v for k, v in data.params.items() if k not in generator}
    path = _materialize(data_dir, seed=seed, **{**_generator_defaults(), **generator})
    params = {
        "path": path,
        "feature_columns": list(synthetic_wind.FEATURE_COLUMNS),
        "target_column": synthetic_wind.TARGET_COLUMN,
        "group_column": synthetic_wind.GROUP_COLUMN,
        "time_column": synthetic_wind.TIME_COLUMN,
        **windows,
    }
    return _parquet_ref(data, data_dir, params, "data.name", task_env)


def resolve_streaming(cfg: RaytrainConfig) -> RaytrainConfig:
    """``cfg`` with ``data.streaming: auto`` decided (``data.stream_choice``): Parquet data
    (``data.path``) streams above a size; the synthetic data and factories' data do not."""
    if cfg.data.streaming != "auto":
        return cfg
    from raytrain_app.data.stream_choice import streams

    resolved = cfg.model_copy(deep=True)
    resolved.data.streaming = bool(cfg.data.path) and streams(
        "auto", _data_path(cfg.data.path, True)
    )
    return resolved


def _parquet_ref(
    data: DataConfig,
    data_dir: Path | StorageLocation,
    params: dict[str, Any],
    key: str,
    task_env: dict[str, str] | None,
) -> FactoryRef:
    """Parquet windows in memory, or (``data.streaming``) prepared once here for workers to
    stream; ``task_env``: what the prepare pass's Ray tasks need to reach object stores."""
    from raytrain_app.data.stream_choice import streams
    from raytrain_app.data.stream_prepare import prepare_stream

    if not streams(data.streaming, params["path"]):
        return FactoryRef(_PARQUET_FACTORY, params, key)
    windows = {k: v for k, v in params.items() if k != "path"}
    prepared = prepare_stream(
        params["path"],
        windows,
        stream_cache_root(data, data_dir),
        resources=dict(data.preprocess_resources),
        task_env=task_env,
    )
    return FactoryRef(STREAM_FACTORY, {"folder": prepared.location}, key)


def stream_cache_root(data: DataConfig, data_dir: Path | StorageLocation) -> StorageLocation:
    """Where prepared streaming data lives: ``data.cache_dir``, or the run's ``data/stream``;
    both places every node sees."""
    if data.cache_dir:
        return StorageLocation.parse(_data_path(data.cache_dir, absolute=True), "data.cache_dir")
    run_data = data_dir if isinstance(data_dir, StorageLocation) else None
    return (run_data or StorageLocation.local(Path(data_dir).absolute())).child("stream")


def _materialize(data_dir: Path | StorageLocation, **arguments: Any) -> str:
    """The synthetic wind data's Parquet file in ``data_dir``, written once; its path or URI."""
    from raytrain_app.data import synthetic_wind

    if isinstance(data_dir, Path) or data_dir.is_local:
        local = data_dir if isinstance(data_dir, Path) else data_dir.local_path
        return str(synthetic_wind.materialize(local, **arguments))
    with tempfile.TemporaryDirectory(prefix="raytrain-data-") as scratch:
        generated = synthetic_wind.materialize(Path(scratch), **arguments)
        target = data_dir.child(generated.name)  # named by a hash of the arguments
        if not target.is_file():
            target.upload(generated)
    return target.uri


def _generator_defaults() -> dict[str, Any]:
    """The generator's own keyword defaults, so they live in one place (its signature)."""
    import inspect

    from raytrain_app.data import synthetic_wind

    signature = inspect.signature(synthetic_wind.generate)
    return {name: signature.parameters[name].default for name in synthetic_wind.GENERATOR_PARAMS}


def build_data(ref: FactoryRef, seed: int) -> DataSplits | StreamSplits:
    """Call the data factory (inside a worker) and check it kept the protocol (or, for
    prepared streaming data, is raytrain's own streaming factory)."""
    splits = import_target(ref.target, ref.config_key)(dict(ref.params), seed)
    if ref.target == STREAM_FACTORY and isinstance(splits, StreamSplits):
        return splits
    if isinstance(splits, RayDataSplits):  # only `raytrain train` on Ray hands them out
        raise BadInputError(ray_data_refusal(ref.config_key, ref.target, "this command"))
    if not isinstance(splits, DataSplits):
        raise BadInputError(
            f"{ref.config_key}={ref.target!r} returned {type(splits).__name__}, not "
            f"raytrain_app.DataSplits; see docs/users/own-model-and-data.md"
        )
    return splits


def build_model(ref: FactoryRef, data_info: dict) -> ModelSpec:
    """Call the model factory and check it kept the protocol."""
    spec = import_target(ref.target, ref.config_key)(dict(ref.params), dict(data_info))
    if not isinstance(spec, ModelSpec):
        raise BadInputError(
            f"{ref.config_key}={ref.target!r} returned {type(spec).__name__}, not "
            f"raytrain_app.ModelSpec; see docs/users/own-model-and-data.md"
        )
    return spec
