"""The ``WorkerTask`` the driver sends its workers: one builder for a run and a sweep's trial.

A run's workers and a trial's single worker run the same loop on the same kind of task:
the resolved config, the plan, the prepared data, the model factory and where to write.
"""

from __future__ import annotations

from typing import Any

from raytrain_app.config import RaytrainConfig, config_to_dict
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.worker.loop import WorkerTask
from raytrain_app.workloads import FactoryRef, model_factory


def worker_task(
    resolved: RaytrainConfig, plan: TrainingPlan, data: FactoryRef, run_dir: str, **extra: Any
) -> WorkerTask:
    """The task of ``resolved`` planned as ``plan``, writing to ``run_dir`` (a path or URI).

    Args:
        extra: the ``WorkerTask`` fields that differ between a run and a trial (its log
            level, its sweep, a data factory's Ray Datasets).
    """
    return WorkerTask(
        config=config_to_dict(resolved),
        plan=plan,
        data=data,
        model=model_factory(resolved.model),
        run_dir=run_dir,
        **extra,
    )
