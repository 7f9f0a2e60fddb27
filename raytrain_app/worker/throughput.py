"""A worker's throughput: samples/s and items/s, the FLOP/s it achieves and its MFU, per
epoch (metrics.csv), per run (summary.json ``throughput``) and live (``achieved``).

FLOP/s per worker = FLOPs per sample (``flop_count``) x the samples one worker trains per
second; MFU = that over the peak of the worker's GPU at the run's precision
(``planning.peak_flops``; none on CPU or for a GPU not in the table).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from raytrain_app.planning.environment import device_gpu_name
from raytrain_app.planning.peak_flops import Peak, no_peak_reason, peak_for, peak_precision
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.worker.flop_count import FlopsPerSample
from raytrain_app.worker.global_metrics import EpochProgress
from raytrain_app.worker.rank_zero import rank_zero_info

logger = logging.getLogger(__name__)


def rate_seconds(progress: EpochProgress) -> float:
    """The seconds an epoch's FLOP/s and MFU are over: its training time (the steps with
    their data waits; not validation or epoch-end checkpoints), as PaLM's and torchtitan's
    MFU take wall time per step. The one place to switch to the goodput account's compute
    seconds."""
    return progress.elapsed_s


class Throughput:
    """One worker's FLOPs per sample and device peak, and the rates they give."""

    def __init__(self, module: nn.Module, plan: TrainingPlan, device: torch.device) -> None:
        self.flops = FlopsPerSample(module, plan.per_worker_batch_size)
        self.peak = _device_peak(device, plan)

    def achieved(self, samples_per_s_per_worker: float) -> dict[str, float]:
        """``flops_per_s_per_worker`` and, where the peak is known, ``mfu`` (a fraction, not
        a percentage) at a rate of samples per second of one worker; {} before the FLOPs are
        known. What live metrics read."""
        if self.flops.value is None:
            return {}
        achieved = self.flops.value * samples_per_s_per_worker
        out = {"flops_per_s_per_worker": achieved}
        if self.peak is not None:
            out["mfu"] = achieved / self.peak.flops_per_s
        return out

    def epoch_fields(
        self, progress: EpochProgress, epoch_samples: int, world_size: int
    ) -> dict[str, float]:
        """An epoch's rates for metrics.csv, after ``progress``'s global means were taken.

        ``elapsed_s`` is the whole epoch's training time, the part before a resume included
        (without the time lost to the interruption), so the rates are over all its steps.
        """
        elapsed = max(progress.elapsed_s, 1e-9)
        fields = {"samples_per_s": epoch_samples / elapsed, "epoch_time_s": progress.elapsed_s}
        items = progress.averages.global_count
        if items is not None:
            fields["items_per_s"] = items / elapsed
        per_worker = epoch_samples / world_size / max(rate_seconds(progress), 1e-9)
        return {**fields, **self.achieved(per_worker)}

    def of_run(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """summary.json's ``throughput``: the run's rates over every epoch (each weighted by
        its time), the FLOPs per sample and the peak MFU is measured against."""
        return {
            "items_per_s": _time_weighted(history, "items_per_s"),
            "flops_per_sample": self.flops.value,
            "flops_per_sample_from": self.flops.source,
            "flops_per_s_per_worker": _time_weighted(history, "flops_per_s_per_worker"),
            "mfu": _time_weighted(history, "mfu"),
            "peak": self.peak.describe() if self.peak else None,
            "peak_flops_per_s": self.peak.flops_per_s if self.peak else None,
        }


def _device_peak(device: torch.device, plan: TrainingPlan) -> Peak | None:
    """The dense peak of this worker's GPU at the plan's precision; None on CPU or for a
    GPU or precision the table lacks (one log line says which)."""
    name = device_gpu_name(device)
    if name is None:
        return None
    precision = peak_precision(plan.precision, plan.tf32)
    peak = peak_for(name, precision)
    if peak is None:
        rank_zero_info(logger, "no MFU: %s", no_peak_reason(name, precision))
    else:
        rank_zero_info(logger, "MFU against the %s", peak.describe())
    return peak


def _time_weighted(history: list[dict[str, Any]], key: str) -> float | None:
    """``key``'s mean over the epochs that have it, weighted by their time; None if none."""
    rows = [row for row in history if key in row]
    seconds = sum(row["epoch_time_s"] for row in rows)
    if not rows or not seconds:
        return None
    return sum(row[key] * row["epoch_time_s"] for row in rows) / seconds
