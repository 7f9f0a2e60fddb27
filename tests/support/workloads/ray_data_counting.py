"""The ray_regression example's model, counting the rows each epoch trained and validated
on (``train_rows``, ``val_rows``: exact global sums over batches and workers), and a step
that fails once, in one worker, when a marker file is named."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from ray_regression import build_model as build_example_model

from raytrain_app import ModelSpec, StepOutput

_calls = 0  # this worker process's steps (a restarted worker counts from 0 again)


def _rows_from_counts(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    return {"rows": float(totals["rows"].sum())}


def build_model(params: dict, data_info: dict) -> ModelSpec:
    """``params``: the example's, plus ``fail_at`` (this process's step to fail at, once)
    and ``marker`` (the file that records the failure happened)."""
    example = build_example_model({"hidden": params.get("hidden", 20)}, data_info)
    fail_at, marker = params.get("fail_at"), params.get("marker")

    def step(module, batch) -> StepOutput:
        global _calls
        out = example.step(module, batch)
        if module.training:
            _calls += 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            if fail_at and rank == 0 and _calls == fail_at and not Path(marker).exists():
                Path(marker).touch()
                raise RuntimeError("injected failure")
        rows = torch.tensor([float(out.num_samples)])
        return StepOutput(out.loss, out.num_samples, out.metrics, counts={"rows": rows})

    return ModelSpec(module=example.module, step=step, metrics_from_counts=_rows_from_counts)
