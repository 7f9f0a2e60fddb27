"""The run directory ``<output_dir>/<name>/``: its paths, and the resume-or-refuse rule."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_app.config import ConfigError, RaytrainConfig, diff_configs, load_config, save_config
from raytrain_app.errors import BadInputError

# Keys that do not change what is trained, so they may differ when resuming. The number
# of workers is one of them: the global batch is the user's number and a global step
# covers the same samples for any world size, so a run checkpointed by 8 workers may
# continue on 4 (train_state.py merges the unfinished epoch's sums). What follows from the
# world size (SyncBatchNorm under auto) and the CPUs each worker and its loader get may
# change with it.
_RESUMABLE_DIFFERENCES = (
    "fault_tolerance",
    "tracking",
    "scaling.num_workers",
    "scaling.cpus_per_worker",
    "distributed.sync_batchnorm",
    "dataloader.num_workers",
)


@dataclass(frozen=True)
class RunDirectory:
    """Paths of one run; the directory is shared storage on multi-node clusters."""

    root: Path

    @classmethod
    def for_config(cls, cfg: RaytrainConfig) -> RunDirectory:
        return cls(Path(cfg.experiment.output_dir).expanduser().resolve() / cfg.experiment.name)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def stop_request(self) -> Path:
        """Created by the driver on a preemption signal; rank 0 polls it between steps."""
        return self.root / ".stop-requested"

    def exists(self) -> bool:
        return self.config.is_file()

    def check_resumable(self, resolved: RaytrainConfig) -> bool:
        """True if an earlier run with this exact config lives here (resume it).

        Raises BadInputError when the directory holds a run with a different config, so
        an earlier run's results are never overwritten.
        """
        if not self.exists():
            # Only the data cache: a run that failed its checks before it started.
            if self.root.exists() and any(p != self.data for p in self.root.iterdir()):
                raise BadInputError(
                    f"run directory '{self.root}' exists but holds no raytrain run "
                    f"(no config.yaml); choose another experiment.name or experiment.output_dir"
                )
            return False
        try:
            previous = load_config(self.config)
        except ConfigError as exc:
            raise BadInputError(
                f"run directory '{self.root}' has an unreadable config.yaml ({exc}); choose "
                f"another experiment.name"
            ) from None
        changed = diff_configs(previous, resolved, ignore=_RESUMABLE_DIFFERENCES)
        if changed:
            shown = ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")
            raise BadInputError(
                f"experiment.name '{resolved.experiment.name}' already holds a run in "
                f"'{self.root}' with a different config ({shown}); re-run with the same config "
                f"to resume it, or set a new experiment.name"
            )
        return True

    def write_config(self, resolved: RaytrainConfig) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        save_config(resolved, self.config)

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary.with_name("summary.json.tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, self.summary)

    def read_summary(self) -> dict[str, Any]:
        return json.loads(self.summary.read_text())
