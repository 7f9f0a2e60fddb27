"""Exact global metrics: sample-weighted sums and additive counts, all-reduced once, and
the running sums of an unfinished epoch that a mid-epoch checkpoint saves."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from raytrain_app.errors import BadInputError


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum each value over all workers with one collective."""
    keys = sorted(sums)
    stacked = torch.stack([sums[k].double() for k in keys])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    return dict(zip(keys, stacked.tolist(), strict=True))


def gather(obj: Any, world_size: int) -> list[Any]:
    """``obj`` from every rank, in rank order."""
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


class Averages:
    """Sample-weighted sums of loss and metrics; exact global means after one all-reduce."""

    def __init__(self, device: torch.device, sums: dict[str, float] | None = None) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {
            key: torch.tensor(value, dtype=torch.float64, device=device)
            for key, value in (sums or {}).items()
        }
        # The items (StepOutput.num_samples) over every worker, once global_means ran.
        self.global_count: float | None = None

    def local_sums(self) -> dict[str, float]:
        return {key: float(value) for key, value in self.sums.items()}

    def add(self, values: dict[str, torch.Tensor], num_samples: int | torch.Tensor) -> None:
        """Add a batch's means weighted by its items, an int or a tensor left on the device
        (neither is read back to the host here)."""
        # A fill on the device, plus a tensor count there or on the CPU (added as a
        # scalar): a copy from the host would wait for the device's queued work.
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        if isinstance(num_samples, torch.Tensor):
            count = count + num_samples.detach().reshape(())
        else:
            count = count.fill_(float(num_samples))
        for key, value in values.items():
            weighted = value.detach().double() * count
            self.sums[key] = (
                self.sums.get(key, torch.zeros((), dtype=torch.float64, device=self.device))
                + weighted
            )
        self.sums["_count"] = self.sums.get("_count", torch.zeros_like(count)) + count

    def global_means(self, prefix: str, keys: list[str]) -> dict[str, float]:
        """Means over every worker; ``keys`` are joined as zeros where this rank saw none."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        for key in ["loss", *keys, "_count"]:
            self.sums.setdefault(key, zero)
        totals = all_reduce_sums(self.sums)
        count = self.global_count = totals.pop("_count")
        return {f"{prefix}{k}": (v / count if count else float("nan")) for k, v in totals.items()}


class Counts:
    """A step's additive ``counts`` (confusion matrices, score histograms) summed over
    batches; exact global totals after one all-reduce."""

    def __init__(
        self, device: torch.device, saved: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {
            key: value.to(device, torch.float64, copy=True) for key, value in (saved or {}).items()
        }
        self._batches = 0  # batches added here; a resumed epoch's saved sums are not checked

    def local(self) -> dict[str, torch.Tensor]:
        """This worker's sums on the CPU, for a mid-epoch checkpoint."""
        return {key: value.cpu() for key, value in self.sums.items()}

    def add(self, counts: Mapping[str, torch.Tensor]) -> None:
        if self._batches and counts.keys() != self.sums.keys():
            raise BadInputError(
                f"the step returned StepOutput.counts with keys {sorted(counts)} after "
                f"{sorted(self.sums)}; return the same keys for every batch"
            )
        self._batches += 1
        for key, value in counts.items():
            value = value.detach().to(self.device, torch.float64)
            total = self.sums.get(key)
            if total is None:
                self.sums[key] = value.clone()
            elif total.shape != value.shape:
                raise BadInputError(_shape_message(key, total.shape, value.shape))
            else:
                total += value

    def global_totals(self, world_size: int) -> dict[str, torch.Tensor]:
        """Sums over every worker, on the CPU; a key some worker never saw (e.g. it had no
        validation batch) counts as zeros there. Empty when no worker has counts."""
        shapes: dict[str, tuple[int, ...]] = {}
        for theirs in gather({k: tuple(v.shape) for k, v in self.sums.items()}, world_size):
            for key, shape in theirs.items():
                if shapes.setdefault(key, shape) != shape:
                    raise BadInputError(_shape_message(key, shapes[key], shape, "workers"))
        keys = sorted(shapes)
        if not keys:
            return {}
        flat = torch.cat(
            [
                self.sums[k].reshape(-1)
                if k in self.sums
                else torch.zeros(math.prod(shapes[k]), dtype=torch.float64, device=self.device)
                for k in keys
            ]
        )
        if world_size > 1 and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        parts = flat.cpu().split([math.prod(shapes[k]) for k in keys])
        return {k: part.reshape(shapes[k]) for k, part in zip(keys, parts, strict=True)}


def _shape_message(key: str, first: Any, other: Any, between: str = "batches") -> str:
    return (
        f"StepOutput.counts[{key!r}] has shape {tuple(first)} and {tuple(other)} in different "
        f"{between}; give each count a fixed shape (e.g. torch.bincount(..., "
        f"minlength=num_classes))"
    )


class EpochProgress:
    """One worker's running sums of the epoch under way: what a mid-epoch resume needs."""

    def __init__(self, device: torch.device, saved: dict[str, Any] | None = None) -> None:
        saved = saved or {}
        self.averages = Averages(device, saved.get("sums", {}))
        self.counts = Counts(device, saved.get("counts", {}))
        self.elapsed_s: float = saved.get("elapsed_s", 0.0)
        self.skipped_steps: int = saved.get("skipped_steps", 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sums": self.averages.local_sums(),
            "counts": self.counts.local(),
            "elapsed_s": self.elapsed_s,
            "skipped_steps": self.skipped_steps,
        }
