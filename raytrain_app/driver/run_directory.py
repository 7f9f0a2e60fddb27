"""The run directory ``<output_dir>/<name>/``: its paths, and the resume-or-refuse rule."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_app.config import ConfigError, RaytrainConfig, diff_configs, dump_config_yaml
from raytrain_app.config.loading import config_from_yaml
from raytrain_app.driver.lease_stores import LEASE_FILE
from raytrain_app.errors import BadInputError
from raytrain_app.storage import StorageLocation, is_uri

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
DATA_DIR = "data"

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
    """One run's files; on multi-node clusters shared storage (a shared filesystem or an
    object store) that every node sees. Every file goes through ``location``."""

    location: StorageLocation

    @classmethod
    def for_config(cls, cfg: RaytrainConfig) -> RunDirectory:
        output = cfg.experiment.output_dir
        if is_uri(output):
            base = StorageLocation.parse(output, "experiment.output_dir")
        else:
            base = StorageLocation.local(Path(output).expanduser().resolve())
        return cls(base.child(cfg.experiment.name))

    def at(self, *parts: str) -> StorageLocation:
        """A file or folder of the run (``at("summary.json")``), wherever the run lives."""
        return self.location.child(*parts)

    @property
    def root(self) -> Path:
        """The run directory as a local path (one on a shared filesystem too).

        Raises:
            ValueError: the run directory is in an object store (use ``location``).
        """
        return self.location.local_path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def data(self) -> Path:
        return self.root / DATA_DIR

    def exists(self) -> bool:
        return self.at(CONFIG_FILE).is_file()

    def check_resumable(self, resolved: RaytrainConfig) -> bool:
        """True if an earlier run with this exact config lives here (resume it).

        Raises BadInputError when the directory holds a run with a different config, so
        an earlier run's results are never overwritten.
        """
        if not self.exists():
            # Only the data cache: a run that failed its checks before it started.
            # The data cache, and the lease of a run that is starting or failed its checks.
            if any(
                item.name != DATA_DIR and not item.name.startswith(LEASE_FILE)
                for item in self.location.list_dir()
            ):
                raise BadInputError(
                    f"run directory '{self.location}' exists but holds no raytrain run "
                    f"(no config.yaml); choose another experiment.name or experiment.output_dir"
                )
            return False
        config = self.at(CONFIG_FILE)
        try:
            previous = config_from_yaml(config.read_text(), f"config file '{config}'")
        except (ConfigError, OSError, UnicodeDecodeError) as exc:
            raise BadInputError(
                f"run directory '{self.location}' has an unreadable config.yaml ({exc}); choose "
                f"another experiment.name"
            ) from None
        changed = diff_configs(previous, resolved, ignore=_RESUMABLE_DIFFERENCES)
        if changed:
            shown = ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")
            raise BadInputError(
                f"experiment.name '{resolved.experiment.name}' already holds a run in "
                f"'{self.location}' with a different config ({shown}); re-run with the same "
                f"config to resume it, or set a new experiment.name"
            )
        return True

    def write_config(self, resolved: RaytrainConfig) -> None:
        self.at(CONFIG_FILE).write_text(dump_config_yaml(resolved))

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.at(SUMMARY_FILE).write_text(json.dumps(summary, indent=2))

    def read_summary(self) -> dict[str, Any]:
        return json.loads(self.at(SUMMARY_FILE).read_text())
