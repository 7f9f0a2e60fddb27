"""The faults workload's model (Linear, BatchNorm, Linear), recording what it trained on.

In this process, ``TRAINED`` collects every training batch and its loss, so a test can
replay the very same batches through a plain PyTorch loop; ``params.hook`` gives the spec
a ``configure_optimizers`` (SGD, no schedule) for the hook's tests.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from faults import build_data
from faults import build_model as faults_model

__all__ = ["TRAINED", "build_data", "build_model"]

TRAINED: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (x, y, loss)


def build_model(params: dict, data_info: dict):
    hook = params.get("hook")
    spec = faults_model({k: v for k, v in params.items() if k != "hook"}, data_info)
    inner = spec.step

    def step(model, batch):
        out = inner(model, batch)
        if model.training:
            TRAINED.append((batch[0].clone(), batch[1].clone(), float(out.loss.detach())))
        return out

    def configure_optimizers(module, lr, total_steps):
        return torch.optim.SGD(module.parameters(), lr=lr * 0.5), None

    return replace(spec, step=step, configure_optimizers=configure_optimizers if hook else None)
