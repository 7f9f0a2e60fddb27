"""The state one invocation shares between benchmarks: settings, the in-process Ray, the data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Settings, usable_cpus
from benchmarks.ray_setup import LocalRay
from benchmarks.workload import Workload, data_params


@dataclass
class Context:
    settings: Settings
    selected: list[str] = field(default_factory=list)  # the benchmarks of this invocation
    local_ray: LocalRay = field(default_factory=lambda: LocalRay(num_cpus=usable_cpus()))
    training_results: dict[str, list[Any]] | None = None  # see training_rounds
    _workload: Workload | None = None

    @property
    def runs_dir(self) -> Path:
        path = self.settings.work_dir / "runs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def data_params(self) -> dict[str, Any]:
        return data_params(self.settings.quick)

    def workload(self) -> Workload:
        """The benchmark data, generated once with raytrain's data factory."""
        if self._workload is None:
            self._workload = Workload.prepare(self.data_params, self.settings.work_dir / "data")
        return self._workload
