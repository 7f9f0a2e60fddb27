"""The built-in image model (resnet_small), saving each rank's BatchNorm running statistics.

``model.params.probe_dir`` names a folder; after every training step, rank ``r`` writes the
running means and variances of its model to ``rank<r>.pt`` there, so a test can compare
the ranks' statistics at the end of a run (Ray Train only returns rank 0's checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from raytrain_app import ModelSpec, StepOutput
from raytrain_app.models import resnet_small


def build_model(params: dict, data_info: dict) -> ModelSpec:
    params = dict(params)
    probe = Path(params.pop("probe_dir"))
    spec = resnet_small.build(params, data_info)

    def step(model: nn.Module, batch) -> StepOutput:
        out = resnet_small.step(model, batch)
        if model.training:  # the forward pass just updated the running statistics
            rank = dist.get_rank() if dist.is_initialized() else 0
            module = getattr(model, "module", model)  # under DDP
            stats = {k: v.clone() for k, v in module.state_dict().items() if ".running_" in k}
            torch.save(stats, probe / f"rank{rank}.pt")
        return out

    return ModelSpec(module=spec.module, step=step, predict=spec.predict)
