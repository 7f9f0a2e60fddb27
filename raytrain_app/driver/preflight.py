"""The workload checked once on the driver, before any worker starts.

The data is prepared (the synthetic set written as Parquet, streaming data into its
store) and built, and the model built from it, so that a broken workload (bad params, a
failing import, too little data) fails as a one-line BadInputError (exit code 2) instead
of as retried worker failures.
"""

from __future__ import annotations

from typing import Any

from raytrain_app.checkpoint.ranking import check_monitor_on_one_batch
from raytrain_app.config import RaytrainConfig
from raytrain_app.data.stream_order import stream_steps_per_epoch
from raytrain_app.data.stream_windows import StreamSplits
from raytrain_app.driver.ray_datasets import RayDataInputs, load_data_splits
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.errors import BadInputError, first_line
from raytrain_app.planning.batch import steps_per_epoch
from raytrain_app.planning.lanes import run_lanes
from raytrain_app.planning.recipe import check_schedule_length
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.planning.store_variables import storage_env_vars
from raytrain_app.worker.recipe import check_hook_alone
from raytrain_app.workloads import FactoryRef, build_model, model_factory, prepare_data


def preflight(
    cfg: RaytrainConfig,
    run_dir: RunDirectory,
    plan: TrainingPlan,
    local: bool = False,
    stream_lanes: int | None = None,
) -> tuple[FactoryRef, RayDataInputs | None]:
    """Prepare the data and build data and model once on the driver; ``stream_lanes``:
    streaming data's lane count (``driver.stream_lanes``; None: chosen from the plan).

    A data factory's Ray Datasets are readied here for Ray Train (``driver.ray_datasets``).

    Returns:
        The prepared data's factory, and the Ray Datasets' inputs if it returns some.
    """
    data_ref = prepare_data(
        cfg.data, run_dir.at("data"), cfg.experiment.seed, task_env=storage_env_vars(cfg)
    )
    command = "local" if local else "train"
    loaded = _checked(
        "data", load_data_splits, data_ref, cfg.experiment.seed, plan.effective_batch_size, command
    )
    ray_inputs = loaded if isinstance(loaded, RayDataInputs) else None
    splits = ray_inputs.plan.splits() if ray_inputs else loaded
    spec = _checked("model", build_model, model_factory(cfg.model), dict(splits.info))
    if plan.gradient_checkpointing and not callable(
        getattr(spec.module, "gradient_checkpointing_enable", None)
    ):
        raise BadInputError(
            f"optimizations.gradient_checkpointing is true but {type(spec.module).__name__} has "
            f"no gradient_checkpointing_enable() method; add one (see raytrain_app/protocol.py) "
            f"or set optimizations.gradient_checkpointing=false"
        )
    check_hook_alone(spec, cfg.train)
    steps = None
    if isinstance(splits, StreamSplits):  # the manifest tells the sizes; read two windows
        check_monitor_on_one_batch(cfg.train.monitor, spec, splits.preview("val", 2))
        batch = plan.effective_batch_size
        lanes = stream_lanes or run_lanes(batch, plan.world_size, plan.worker_range)
        steps = stream_steps_per_epoch(splits.manifest, batch, lanes)
    else:
        check_monitor_on_one_batch(cfg.train.monitor, spec, splits.val, splits.collate)
        if not ray_inputs:  # Ray Datasets were counted when readied
            steps = steps_per_epoch(len(splits.train), plan.effective_batch_size)
    if steps:  # a milestone in steps past the end is known once the data is
        check_schedule_length(cfg.train.schedule, steps * cfg.train.epochs, steps)
    return data_ref, ray_inputs


def _checked(section: str, factory: Any, *args: Any) -> Any:
    """Call a workload factory; its ValueError/TypeError becomes a one-line bad-input error."""
    try:
        return factory(*args)
    except BadInputError:
        raise
    except (ValueError, TypeError, KeyError, FileNotFoundError) as exc:
        raise BadInputError(
            f"{section}: {first_line(exc)}; fix the {section} section of the config"
        ) from exc
