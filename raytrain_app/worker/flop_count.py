"""FLOPs per sample of a run: the model's own ``flops_per_sample``, or counted once by
torch's ``FlopCounterMode`` over the run's first micro-batch, as training runs it.

The count is of the real first micro-batch (its forward and backward, through DDP), not
of an extra pass: the step function runs no more often than it would, every op computes
as it does uncounted (``OwnKernels``), and the model, its buffers and the random streams
go on exactly as without the count. What is counted is
what torch's counter knows: matrix multiplies, convolutions and attention (elementwise
ops, norms and the loss are free), forward and backward, as PaLM's and torchtitan's MFU
count (attention on CPU too: ``_cpu_attention_formulas``); the optimizer's update is left
out. A model that recomputes activations in backward (gradient checkpointing) is counted
with the recomputation, as it runs.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode

from raytrain_app.errors import BadInputError
from raytrain_app.worker.rank_zero import rank_zero_info

logger = logging.getLogger(__name__)


def _as_counted(formula: Any) -> Any:
    """A formula of torch's registry (shapes already taken from the tensors) given as a
    ``custom_mapping`` entry, which would otherwise take the shapes a second time."""

    def count(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    count._get_raw = True  # type: ignore[attr-defined]
    return count


def _cpu_attention_formulas() -> dict[Any, Any]:
    """torch's own attention formulas for the CPU kernel of ``scaled_dot_product_attention``,
    which torch 2.13's counter leaves out (it counts the GPU kernels): the same arguments
    lead both, so a transformer on CPU is counted as on a GPU."""
    aten, registry = torch.ops.aten, flop_counter.flop_registry
    pairs = {
        "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu_backward": (
            "_scaled_dot_product_flash_attention_backward"
        ),
    }
    formulas = {}
    for cpu, gpu in pairs.items():
        op, known = getattr(aten, cpu, None), registry.get(getattr(aten, gpu, None))
        if op is not None and op not in registry and known is not None:
            formulas[op] = _as_counted(known)
    return formulas


class OwnKernels(TorchDispatchMode):
    """Entered inside a ``FlopCounterMode``: every op returns exactly what it returns
    uncounted.

    torch's counter runs an op it has no formula for through its decomposition
    (``CompositeImplicitAutograd``), to count the matmuls inside, and returns that result:
    SiLU's backward (in every Llama's MLP) then rounds otherwise than its own kernel, so
    the counted micro-batch's gradients changed, and so did a resumed run, which counts
    again. Here such an op goes on to the counter with ``meta`` copies of its inputs, which
    have shapes and no data (nothing computed, no random number drawn, no input changed),
    to be counted; then it runs on the real inputs with no mode at all.
    """

    supports_higher_order_operators = True  # passed on to the counter, which counts them

    def __init__(self, formulas: Mapping[Any, Any]) -> None:
        super().__init__()
        self.formulas = formulas  # the counter's registry: ops it counts as they are

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.formulas or not _has_decomposition(func):
            return func(*args, **kwargs)  # on to the counter
        with _disable_current_modes():
            on_meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        try:
            func(*on_meta[0], **on_meta[1])  # the counter decomposes and counts it
        except Exception:  # some part has no meta kernel: that part goes uncounted
            logger.debug("FLOPs of %s not counted: no meta kernel", func)
        with _disable_current_modes():
            return func(*args, **kwargs)


def _has_decomposition(func: Any) -> bool:
    """Whether torch's counter would run ``func`` through its decomposition."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), key
    )


def own_flops_per_sample(module: nn.Module) -> float | None:
    """The model's ``flops_per_sample`` (a number, or a method returning one); None when it
    has none."""
    own = getattr(module, "flops_per_sample", None)
    if own is None:
        return None
    value = own() if callable(own) else own
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise BadInputError(
            f"the model's flops_per_sample is {value!r}; make it the training FLOPs of one "
            f"sample (forward and backward) as a positive number, or remove it to have "
            f"raytrain count them"
        )
    return float(value)


class FlopsPerSample:
    """A run's FLOPs per sample: the model's own, else counted on the first micro-batch
    this worker process trains (a resumed run counts again)."""

    def __init__(self, module: nn.Module, micro_batch: int) -> None:
        self.micro_batch = micro_batch  # the samples of one micro-batch
        self.value = own_flops_per_sample(module)
        self.source = "model" if self.value is not None else None

    @property
    def pending(self) -> bool:
        """Whether the next micro-batch is to be counted."""
        return self.source is None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the FLOPs of the micro-batch whose forward and backward run in the block.

        Run it eagerly: under torch.compile the counter's dispatch mode makes Dynamo skip
        the frame, and mark its code never to be compiled again.
        """
        self.source = "counted"  # one try: a failing step fails the run anyway
        formulas = _cpu_attention_formulas()
        with (
            FlopCounterMode(display=False, custom_mapping=formulas) as counter,
            OwnKernels(counter.flop_registry),
        ):
            yield
        self.value = counter.get_total_flops() / self.micro_batch
        rank_zero_info(
            logger,
            "FLOPs per sample: %.4g (forward and backward, counted on one micro-batch of %d)",
            self.value,
            self.micro_batch,
        )
