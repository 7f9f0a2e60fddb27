"""The item weighting of one step (``worker/item_weights.py``), in this process: equal counts
backpropagate exactly what an unweighted accumulation did, varying counts (ints, tensors,
summed losses, a micro-batch without items) give the gradient of the mean over every item,
and a step's bad count or reduction is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain_app.errors import BadInputError
from raytrain_app.protocol import StepOutput
from raytrain_app.worker.global_metrics import Averages
from raytrain_app.worker.item_weights import StepItems, backward_loss, rescale_gradients

ACCUM = 3  # not a power of two: dividing by it rounds


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _accumulate(micro_batches: list, reduction: str, tensor_counts: bool) -> torch.Tensor:
    """The gradient raytrain's step leaves for ``micro_batches`` ((x, y) pairs) on one rank
    whose global batch is ``ACCUM`` micro-batches of 4 samples."""
    model, items = _model(), StepItems()
    for x, y in micro_batches:
        loss = nn.functional.mse_loss(model(x).squeeze(1), y, reduction=reduction)
        count = torch.tensor(len(y)) if tensor_counts else len(y)
        out = StepOutput(loss=loss, num_samples=count, loss_reduction=reduction)
        items.add(out.num_samples)
        backward_loss(out, items_per_rank=4 * ACCUM).backward()
    rescale_gradients(model.parameters(), 4 * ACCUM, items.total(torch.zeros(())))
    return _grads(model)


def _batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    random = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 4, generator=random), torch.randn(n, generator=random)) for n in sizes]


@pytest.mark.parametrize("tensor_counts", [False, True], ids=["int", "tensor"])
def test_equal_counts_train_bit_for_bit_as_an_unweighted_accumulation(tensor_counts):
    batches = _batches([4] * ACCUM)
    model = _model()
    for x, y in batches:  # the step before item weighting: loss / grad_accum_steps
        (nn.functional.mse_loss(model(x).squeeze(1), y) / ACCUM).backward()
    assert torch.equal(_accumulate(batches, "mean", tensor_counts), _grads(model))


@pytest.mark.parametrize("tensor_counts", [False, True], ids=["int", "tensor"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_varying_counts_give_the_gradient_of_the_mean_over_every_item(reduction, tensor_counts):
    batches = _batches([5, 1, 9])
    model = _model()
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
    nn.functional.mse_loss(model(x).squeeze(1), y).backward()  # one mean over all 15 items
    weighted = _accumulate(batches, reduction, tensor_counts)
    assert torch.allclose(weighted, _grads(model), rtol=1e-6, atol=1e-7)


def test_a_micro_batch_without_items_adds_nothing_and_no_items_at_all_no_gradient():
    batches = _batches([5, 0, 9])
    with_empty = _accumulate(batches, "sum", tensor_counts=True)
    assert torch.allclose(with_empty, _accumulate(batches[::2], "sum", True), rtol=1e-6)
    assert torch.equal(_accumulate(_batches([0, 0]), "sum", False), torch.zeros_like(with_empty))


def test_metrics_take_a_count_on_the_device_as_an_int_and_a_summed_loss_as_its_mean():
    by_int, by_tensor = Averages(torch.device("cpu")), Averages(torch.device("cpu"))
    for count in (3, 0, 7):
        out = StepOutput(loss=torch.tensor(2.0 * count), num_samples=count, loss_reduction="sum")
        by_int.add({"loss": out.mean_loss}, count)
        by_tensor.add({"loss": out.mean_loss}, torch.tensor(count))
    assert (
        by_int.global_means("train_", [])
        == by_tensor.global_means("train_", [])
        == {"train_loss": 2.0}
    )


def test_a_bad_reduction_or_count_is_refused_in_one_line():
    with pytest.raises(BadInputError, match="StepOutput.loss_reduction='avg'; return 'mean'"):
        StepOutput(loss=torch.tensor(1.0), num_samples=2, loss_reduction="avg")
    with pytest.raises(BadInputError, match=r"num_samples is a tensor of shape \(2,\)"):
        StepOutput(loss=torch.tensor(1.0), num_samples=torch.tensor([1, 2]))
