"""What every benchmark shares: settings, interleaved repeats, medians and the result record."""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Settings:
    """Knobs of one invocation.

    Attributes:
        repeats: measured rounds per benchmark (each round runs every variant once).
        quick: smaller data and fewer epochs, for a smoke run of the suite.
        work_dir: scratch space for run directories, stamp files and Ray temp dirs.
    """

    repeats: int = 3
    quick: bool = False
    work_dir: Path = field(default_factory=Path)

    def scratch(self, name: str) -> Path:
        """A fresh, unique directory under ``work_dir``."""
        path = self.work_dir / f"{name}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path


def unique_name(*parts: Any) -> str:
    """An experiment name no earlier run used (a reused name would resume that run)."""
    return "-".join(str(p) for p in parts) + f"-{uuid.uuid4().hex[:6]}"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# A measured run during which other work used more than this share of all CPUs is
# repeated (the machine is shared: someone else's tests would distort the timing).
DISTURBED_PERCENT = 15.0
MAX_ATTEMPTS = 3
# Labels of the runs that were repeated because of other work (recorded in the results).
REPEATED_RUNS: list[str] = []


def interleave(
    variants: dict[str, Callable[[int], Any]], repeats: int, warmup_rounds: int = 0
) -> dict[str, list[Any]]:
    """Run ``variants`` in rounds A B A B ...; return each variant's measured results.

    Each callable gets the round index (negative for warm-up rounds, whose results are
    dropped), so repeated runs can use unique names. A run during which other processes
    kept the CPUs busy is repeated (at most ``MAX_ATTEMPTS`` times); dict results get the
    foreign CPU share they ran with as ``foreign_cpu_percent``.
    """
    results: dict[str, list[Any]] = {name: [] for name in variants}
    for round_index in range(-warmup_rounds, repeats):
        for name, run in variants.items():
            label = "warm-up" if round_index < 0 else f"round {round_index + 1}/{repeats}"
            value = measure_undisturbed(functools.partial(run, round_index), f"{label}, {name}")
            if round_index >= 0:
                results[name].append(value)
    return results


def measure_undisturbed(run: Callable[[], Any], label: str) -> Any:
    """``run()``, repeated while other work took more than ``DISTURBED_PERCENT`` of the CPUs."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        watch = CpuWatch.get()
        before = watch.mark()
        start = time.perf_counter()
        value = run()
        foreign = foreign_percent(before, watch.mark())
        logger.info(
            "  %s: %s (%.1f s, other work %.0f %% CPU)",
            label,
            _short(value),
            time.perf_counter() - start,
            foreign,
        )
        if isinstance(value, dict):
            value["foreign_cpu_percent"] = round(foreign, 1)
        if foreign <= DISTURBED_PERCENT:
            break
        if attempt < MAX_ATTEMPTS:
            logger.warning("  %s was disturbed by other work; waiting, then repeating it", label)
            REPEATED_RUNS.append(f"{label} ({foreign:.0f} % CPU by other work)")
            wait_until_quiet(QUIET_PERCENT, 600)
    return value


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        shown = {k: v for k, v in value.items() if isinstance(v, int | float)}
        return ", ".join(f"{k}={v:.4g}" for k, v in list(shown.items())[:4])
    return str(value)[:80]


def ratio_record(
    *,
    candidate: str,
    baseline: str,
    samples: dict[str, list[float]],
    goal: float | None,
    higher_is_better: bool = False,
    unit: str,
    what: str,
    **extra: Any,
) -> dict[str, Any]:
    """The JSON record of a ``candidate / baseline`` ratio of medians.

    ``goal`` is an upper bound on the ratio (a lower bound when ``higher_is_better``).
    """
    medians = {name: median(values) for name, values in samples.items()}
    ratio = medians[candidate] / medians[baseline]
    pairs = [c / b for c, b in zip(samples[candidate], samples[baseline], strict=False)]
    return {
        "what": what,
        "ratio": round(ratio, 4),
        "goal": None if goal is None else f"{'>=' if higher_is_better else '<='} {goal}",
        "goal_met": None
        if goal is None
        else (ratio >= goal if higher_is_better else ratio <= goal),
        "candidate": candidate,
        "baseline": baseline,
        "unit": unit,
        "median": {k: round(v, 6) for k, v in medians.items()},
        "pairwise_ratios": [round(r, 4) for r in pairs],
        "raw": {k: [round(v, 6) for v in vs] for k, vs in samples.items()},
        **extra,
    }


def machine_name() -> str:
    """What hardware this is: the GPU model if any, else ``cpu<cores>-<arch>``."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return "gpu-" + "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu{cores}-{platform.machine()}"


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def import_torch_cpu_s(tries: int = 3) -> float:
    """The machine's speed when the suite starts: the median user CPU seconds of a fresh
    interpreter that imports torch. This shared VM's speed drifts by day (1.25 s on a quiet
    morning, 2.0-2.5 s on a slow night, as /usr/bin/time's %U), and seconds measured on
    different days compare only beside it; ratios within one run need no such figure."""
    spent = []
    for _ in range(tries):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent.append(after.ru_utime - before.ru_utime)
    return round(median(spent), 2)


# Share of all CPUs used by other work above which the suite waits before measuring.
QUIET_PERCENT = DISTURBED_PERCENT


class CpuWatch:
    """Client of the ``cpu_watch`` helper process: this suite's CPU use vs other work."""

    _instance: CpuWatch | None = None

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.cpu_watch", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )

    @classmethod
    def get(cls) -> CpuWatch:
        if cls._instance is None or cls._instance.process.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def _send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def mark(self) -> dict[str, int]:
        """Cumulative clock ticks: ``own`` (this suite), ``foreign``, ``total`` (all CPUs)."""
        self._send("mark")
        assert self.process.stdout is not None
        return json.loads(self.process.stdout.readline())

    def add_marker(self, text: str) -> None:
        """Count processes whose command line contains ``text`` as the suite's own."""
        self._send(f"marker {text}")

    @classmethod
    def stop(cls) -> None:
        if cls._instance is not None:
            cls._instance.process.kill()
            cls._instance.process.wait()
            cls._instance = None


def foreign_percent(before: dict[str, int], after: dict[str, int]) -> float:
    """Share of all CPUs that other people's work used between two ``CpuWatch.mark``s."""
    total = max(after["total"] - before["total"], 1)
    return 100.0 * (after["foreign"] - before["foreign"]) / total


def foreign_busy_percent(seconds: float = 2.0) -> float:
    """Share of all CPUs that other people's work used over the next ``seconds``."""
    watch = CpuWatch.get()
    before = watch.mark()
    time.sleep(seconds)
    return foreign_percent(before, watch.mark())


def wait_until_quiet(threshold_percent: float, max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until other work leaves the CPUs mostly idle; the last
    share of the CPUs it used.

    Other people's jobs on a 2-core machine would distort every timing here, so each
    benchmark starts only once the CPUs are quiet; what was seen is recorded.
    """
    deadline = time.monotonic() + max_wait_s
    busy = foreign_busy_percent()
    while busy > threshold_percent and time.monotonic() < deadline:
        logger.warning("machine busy (%.0f %% CPU by other work); waiting to start", busy)
        time.sleep(10)
        busy = foreign_busy_percent()
    return busy
