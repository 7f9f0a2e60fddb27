"""A streaming run's lane count on the driver: chosen for a new run, read back for a resume.

The order streaming data trains in depends on the lane count C (``planning.lanes``), and
C depends on the world sizes a run may take. A resume may take another world size
(``scaling.num_workers`` may change), so it keeps the C its checkpoints record rather
than choosing again; the workers get it in their task, and record it in every checkpoint.
"""

from __future__ import annotations

from raytrain_app.checkpoint.ranking import metas_newest_first
from raytrain_app.config import RaytrainConfig
from raytrain_app.errors import BadInputError
from raytrain_app.planning.lanes import MAX_LANES, STREAM_LANES_KEY, legacy_lanes, run_lanes
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.storage import StorageLocation


def stream_lanes(
    resolved: RaytrainConfig, plan: TrainingPlan, checkpoints: StorageLocation | None
) -> int | None:
    """C for the run of ``resolved`` (its ``data.streaming`` decided); None when its data
    does not stream. ``checkpoints``: the run's checkpoints folder when it resumes.

    Raises:
        PlanError: the run's world sizes cannot share the recorded C, or no C serves them.
    """
    if resolved.data.streaming is not True:
        return None
    batch = plan.effective_batch_size
    recorded = recorded_lanes(checkpoints, batch) if checkpoints is not None else None
    return run_lanes(batch, plan.world_size, plan.worker_range, recorded)


def recorded_lanes(checkpoints: StorageLocation, global_batch: int) -> int | None:
    """The C that the newest readable checkpoint under ``checkpoints`` records (one
    written before C was recorded: the rule of then); None without a checkpoint."""
    for where, meta in metas_newest_first(checkpoints):
        if meta is None:
            continue
        lanes = meta.get(STREAM_LANES_KEY)
        if lanes is None:
            return legacy_lanes(global_batch)
        if type(lanes) is not int or not 0 < lanes <= MAX_LANES or global_batch % lanes:
            raise BadInputError(
                f"'{where}/meta.json' records {STREAM_LANES_KEY}={lanes!r}, not a lane count "
                f"of train.global_batch_size={global_batch}; it was edited or damaged: delete "
                f"that checkpoint to resume from an older one, or set a new experiment.name"
            )
        return lanes
    return None
