"""A W&B run in offline mode under ``<run dir>/wandb`` (``wandb sync`` uploads it); a
resumed run continues the same W&B run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from raytrain_app.tracking.base import Tracker, epoch_scalars


class WandbTracker(Tracker):
    """A W&B run in offline mode under ``<run dir>/wandb``; ``wandb sync`` uploads it."""

    def __init__(
        self, run_dir: Path, project: str, name: str, params: dict, run_id: str | None
    ) -> None:
        import wandb

        self.run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project=project,
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            config=params,
            settings=wandb.Settings(console="off", silent=True, disable_git=True),
        )
        self.run_id = self.run.id

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({f"step/{key}": value for key, value in scalars.items()}, step=step)

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log(
            {f"epoch/{key}": value for key, value in epoch_scalars(row).items()}, step=step
        )

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() returns before W&B's service has written the offline file; shutting the
        # service down waits for it (this process may exit right after training).
        wandb.teardown()
