"""What ``raytrain plan`` shows of the data: whether it streams, how much there is, where
it is prepared, the prepare pass's path and memory (before it runs) and, once prepared,
its windows and steps per epoch. Reads a listing, the files' footers and, if present, the
prepared manifest; never a row."""

from __future__ import annotations

from typing import Any

from raytrain_app.config import RaytrainConfig
from raytrain_app.data.stream_budget import SHUFFLE_TASK_COPIES
from raytrain_app.data.stream_order import stream_steps_per_epoch
from raytrain_app.data.stream_prepare import locate_store
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.planning.lanes import run_lanes
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.worker.stream_batches import read_ahead_bytes
from raytrain_app.workloads import resolve_streaming, stream_cache_root


def data_plan(cfg: RaytrainConfig, plan: TrainingPlan) -> dict[str, Any] | None:
    """The data's part of the plan; None for data that never streams (a factory's data,
    the synthetic images) or the synthetic wind data loaded in memory."""
    data = resolve_streaming(cfg).data
    if data.target or data.name == "synthetic_images" or not data.streaming:
        return None if not data.path else {"streaming": False}
    batch = plan.effective_batch_size
    lanes = run_lanes(batch, plan.world_size, plan.worker_range)
    where = dict(data.preprocess_resources) or "any node"
    out: dict[str, Any] = {"streaming": True, "lanes": lanes, "preprocess_on": where}
    if not data.path:  # the synthetic wind data is generated when the run starts
        return out
    root = stream_cache_root(data, RunDirectory.for_config(cfg).at("data"))
    spot = locate_store(data.path, data.params, root)
    window = spot.args["context_length"] + spot.args["horizon"]
    columns = len(spot.args["feature_columns"]) + 1
    out.update(
        source_files=len(spot.files),
        source_bytes=spot.source_bytes,
        prepared_folder=spot.store.uri,
        read_ahead_bytes=read_ahead_bytes(
            spot.rows_per_group, window, columns, lanes // plan.world_size
        ),
    )
    manifest = spot.prepared()
    if manifest is not None:
        out.update(
            prepared=True,
            train_windows=manifest.chunks("train").num_windows,
            val_windows=manifest.chunks("val").num_windows,
            steps_per_epoch=stream_steps_per_epoch(manifest, batch, lanes),
        )
    else:
        out.update(prepared=False, prepare=spot.budget().to_dict())
    return out


def data_plan_line(described: dict[str, Any] | None) -> list[str]:
    """The plan's ``data`` line(s) for people."""
    if described is None:
        return []
    if not described["streaming"]:
        return ["data        : Parquet loaded into every worker (data.streaming)"]
    where = described["preprocess_on"]
    where = where if isinstance(where, str) else f"nodes offering {where}"
    line = f"data        : streaming over {described['lanes']} lanes, prepared on {where}"
    if "source_files" not in described:
        return [line + " when the run starts"]
    size = f"{described['source_files']} file(s), {described['source_bytes'] / 1e6:.1f} MB"
    lines = [f"{line}; {size} of Parquet"]
    mib = described["read_ahead_bytes"] / 2**20
    lines.append(f"              read ahead about {mib:.0f} MiB per worker")
    if described["prepared"]:
        lines.append(
            f"              prepared in {described['prepared_folder']}: "
            f"{described['train_windows']:,} train / {described['val_windows']:,} val windows, "
            f"{described['steps_per_epoch']} steps per epoch"
        )
    else:
        lines.append(
            f"              prepared when the run starts, into {described['prepared_folder']}"
        )
        lines.append(_prepare_line(described["prepare"]))
    return lines


def _prepare_line(budget: dict[str, Any]) -> str:
    """The prepare pass's path and what it holds (``stream_budget.PrepareBudget``)."""
    mib = {k: v / 2**20 for k, v in budget.items() if k.endswith("_bytes")}
    if budget["path"] == "direct":
        return (
            f"              prepare pass: direct, {budget['tasks']} task(s) each reading "
            f"its series' own row groups (at most {mib['task_bytes']:.1f} MiB of rows a task); "
            "nothing shuffled, the driver holding a row of metadata a series"
        )
    return (
        f"              prepare pass: shuffle (series interleaved in the files) of "
        f"{mib['data_bytes']:.1f} MiB in {budget['tasks']} block(s) of about "
        f"{mib['task_bytes']:.1f} MiB (a task holding up to "
        f"{SHUFFLE_TASK_COPIES * mib['task_bytes']:.1f} MiB, one a CPU); up to "
        f"{mib['object_store_bytes']:.1f} MiB in Ray's object store, spilled to disk beyond it"
    )
