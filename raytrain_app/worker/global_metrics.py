"""Exact global metrics: sample-weighted sums, all-reduced once, and the running sums of
an unfinished epoch that a mid-epoch checkpoint saves."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


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

    def local_sums(self) -> dict[str, float]:
        return {key: float(value) for key, value in self.sums.items()}

    def add(self, values: dict[str, torch.Tensor], num_samples: int) -> None:
        for key, value in values.items():
            weighted = value.detach().double() * num_samples
            self.sums[key] = (
                self.sums.get(key, torch.zeros((), dtype=torch.float64, device=self.device))
                + weighted
            )
        count = torch.tensor(float(num_samples), dtype=torch.float64, device=self.device)
        self.sums["_count"] = self.sums.get("_count", torch.zeros_like(count)) + count

    def global_means(self, prefix: str, keys: list[str]) -> dict[str, float]:
        """Means over every worker; ``keys`` are joined as zeros where this rank saw none."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        for key in ["loss", *keys, "_count"]:
            self.sums.setdefault(key, zero)
        totals = all_reduce_sums(self.sums)
        count = totals.pop("_count")
        return {f"{prefix}{k}": (v / count if count else float("nan")) for k, v in totals.items()}


class EpochProgress:
    """One worker's running sums of the epoch under way: what a mid-epoch resume needs."""

    def __init__(self, device: torch.device, saved: dict[str, Any] | None = None) -> None:
        saved = saved or {}
        self.averages = Averages(device, saved.get("sums", {}))
        self.elapsed_s: float = saved.get("elapsed_s", 0.0)
        self.skipped_steps: int = saved.get("skipped_steps", 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sums": self.averages.local_sums(),
            "elapsed_s": self.elapsed_s,
            "skipped_steps": self.skipped_steps,
        }
