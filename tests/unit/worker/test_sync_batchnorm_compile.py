"""SyncBatchNorm under torch.compile, on two real gloo ranks: each synchronised layer is
one clean graph break (torch 2.13 cannot trace the statistics gather of either kind), the
rest of the model compiles, and training matches eager exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gloo_ranks import run_on_two_ranks
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from raytrain_app.worker.sync_batchnorm import CudaSyncBatchNorm, convert_sync_batchnorm

STEPS = 2


class _Block(nn.Module):
    """conv-BN-ReLU twice, as in a ResNet block: two BatchNorm layers per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def _train(model: nn.Module, rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for _ in range(STEPS):
        out = model(torch.randn(4, 3, 10, 10, generator=generator))
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(out.detach())
    return outputs


def _breaks() -> dict[str, int]:
    return {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}


def _compiled_and_eager(rank: int) -> dict:
    torch.manual_seed(0)
    eager = convert_sync_batchnorm(_Block(), torch.device("cpu"))
    torch.manual_seed(0)
    module = convert_sync_batchnorm(_Block(), torch.device("cpu"))
    counted = CompileCounterWithBackend("aot_eager")  # the backward traced too
    counters.clear()
    compiled = _train(torch.compile(module, backend=counted), rank)
    frames, breaks = counted.frame_count, _breaks()
    return {
        "eager": (_train(eager, rank), eager.state_dict()),
        "compiled": (compiled, module.state_dict()),
        "frames": frames,
        "breaks": breaks,
    }


def _cuda_layer_under_compile(rank: int) -> dict:
    """torch's SyncBatchNorm cannot run on CPU: its synchronised path is replaced by
    BatchNorm's own (traceable) forward, to see whether dynamo would trace it."""
    CudaSyncBatchNorm.synchronised_forward = nn.BatchNorm2d.forward
    torch.manual_seed(0)
    model = convert_sync_batchnorm(_Block(), torch.device("cuda"))
    counted = CompileCounterWithBackend("eager")
    counters.clear()
    torch.compile(model, backend=counted)(torch.randn(4, 3, 10, 10))
    return {"frames": counted.frame_count, "breaks": _breaks()}


def _both(rank: int) -> dict:
    return {"gloo": _compiled_and_eager(rank), "cuda": _cuda_layer_under_compile(rank)}


def test_synced_batchnorm_is_one_graph_break_per_layer_and_trains_as_eager(tmp_path):
    for rank in run_on_two_ranks(_both, tmp_path, timeout_s=300):
        gloo, cuda = rank["gloo"], rank["cuda"]
        eager_outputs, eager_state = gloo["eager"]
        compiled_outputs, compiled_state = gloo["compiled"]
        for eager_out, compiled_out in zip(eager_outputs, compiled_outputs, strict=True):
            torch.testing.assert_close(compiled_out, eager_out)
        for key, value in eager_state.items():  # weights and the running statistics
            torch.testing.assert_close(compiled_state[key], value, msg=key)
        # conv1 | bn1 | relu, conv2 | bn2 | relu, head: three graphs around two layers,
        # compiled once (the second step reuses them), split nowhere else
        assert gloo["frames"] == 3
        assert [reason.split()[:3] for reason in gloo["breaks"]] == [
            ["Skip", "calling", "`torch.compiler.disable()`d"]
        ]
        # torch's layer (on GPUs) leaves the graph the same way
        assert cuda["frames"] == 3 and list(cuda["breaks"]) == list(gloo["breaks"])


def _resnet_checkpointed_under_compile(rank: int) -> dict:
    """resnet_small with synchronised BatchNorm, compiled and checkpointed, against the
    same model eager and without checkpointing: the synchronised blocks run their
    checkpoint eagerly (with frozen statistics on recompute), so the running statistics
    are updated once per step, as without checkpointing."""
    from raytrain_app.models.resnet_small import ResNetSmall

    def model() -> nn.Module:
        torch.manual_seed(0)
        return convert_sync_batchnorm(
            ResNetSmall(num_classes=3, widths=[4, 8]), torch.device("cpu")
        )

    reference, module = model(), model()
    module.gradient_checkpointing_enable()
    compiled = torch.compile(module, backend="aot_eager")
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 3, 12, 12, generator=generator) for _ in range(STEPS)]
    for net in (reference, compiled):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for x in batches:
            net(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"reference": reference.state_dict(), "compiled": module.state_dict()}


def test_a_checkpointed_resnet_with_synced_batchnorm_compiles_and_counts_statistics_once(
    tmp_path,
):
    for rank in run_on_two_ranks(_resnet_checkpointed_under_compile, tmp_path, timeout_s=300):
        for key, value in rank["reference"].items():  # num_batches_tracked: once a step
            torch.testing.assert_close(rank["compiled"][key], value, msg=key)
