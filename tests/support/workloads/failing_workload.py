"""A workload whose training step raises inside the workers (after a clean preflight)."""

from __future__ import annotations

from sine_regression import build_data, build_model

from raytrain_app import ModelSpec

__all__ = ["build_data", "build_model_that_fails"]


def _failing_step(module, batch):
    raise RuntimeError("the user's step exploded")


def build_model_that_fails(params: dict, data_info: dict) -> ModelSpec:
    return ModelSpec(module=build_model(params, data_info).module, step=_failing_step)
