"""What every rank must agree on after each step: did any rank's loss go non-finite, did the
driver ask to stop. A rank that skipped, stopped or checkpointed at another step than the
others would hang the next collective. The same sum carries the step's items over every
rank, by which the gradients are divided (``worker/item_weights.py``).

DDP all-reduces the gradients once per optimizer step anyway, so with its default all-reduce
the flags ride along in the step's last gradient bucket (a communication hook): a separate
tiny all-reduce per step costs measurably more (benchmarks/README.md). Under torch.compile
too: DDP's reducer, and with it the hook, runs outside the compiled graphs. Where another
hook owns the all-reduce (gradient compression), under FSDP, with parameters of less than
fp32 (a bucket of bf16 would round the count of items) or with a single worker, one tiny
all-reduce per step (float64) carries them instead.

Reading the agreed flags on the host is the decision to make per step. On CPU they are
read at once, as they always were. On a GPU a read (``.tolist()``) would wait for the
step's whole backward pass and leave the device idle while the host queues the next step,
every step. So there the agreed flags are copied into pinned host memory without blocking,
with a CUDA event behind the copy, and the loop (``worker/loop.py``) reads them:

- with ``train.on_nonfinite=stop`` (the default), one step late: step N's flags are read
  after step N+1 is queued, when their copy has normally finished. Every rank reads the
  same agreed values at the same step, so all still stop together, one step later than on
  CPU; a non-finite loss still ends the run naming step N, before any checkpoint or report
  (a step that a checkpoint or report follows has its own flags read first), after one
  more step's work that the failed run discards;
- with ``train.on_nonfinite=skip``, at once, since the skip must be known before the
  optimizer step: the host then waits on the copy's event, the price of a host-side skip.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class StepAgreement:
    """This rank's flags of a step in, for each flag whether any rank set it out."""

    def __init__(
        self, model: nn.Module, world_size: int, fuse: bool, read_late: bool = False
    ) -> None:
        self.world_size = world_size
        self.read_late = read_late  # the loop may act on the flags one step late (GPUs)
        self._local: torch.Tensor | None = None
        self._agreed: torch.Tensor | None = None
        self.fused = (
            fuse
            and world_size > 1
            and isinstance(model, nn.parallel.DistributedDataParallel)
            and all(p.dtype in _EXACT_DTYPES for p in model.parameters() if p.requires_grad)
        )
        if self.fused:
            model.register_comm_hook(self, _all_reduce_with_flags)

    def send(self, flags: torch.Tensor, items: torch.Tensor | None = None) -> None:
        """This rank's flags (1.0 for yes) and the step's items (a scalar, summed over the
        ranks), before the backward pass of the step's last micro-batch: the one in which
        DDP all-reduces the gradients."""
        if items is not None:
            flags = torch.cat([flags.double(), items.double().reshape(1)])
        self._local, self._agreed = flags, None

    def receive_flags(self) -> AgreedFlags:
        """The agreed flags after that backward pass, read when the loop needs them."""
        if self.fused:
            agreed = self._agreed
            if agreed is None:
                raise RuntimeError("DDP's gradient all-reduce did not run in this step")
        else:
            agreed = self._local
            if self.world_size > 1 and dist.is_initialized():
                dist.all_reduce(agreed, op=dist.ReduceOp.SUM)  # as the fused: counts add
        self._local = self._agreed = None
        return AgreedFlags(agreed, self.read_late)


class AgreedFlags:
    """One step's flags as every rank agreed them: [a loss was non-finite, stop], and the
    step's items over every rank (``items``: a scalar on the device; None if not sent).

    A CUDA tensor is copied into pinned host memory without blocking the host; the values
    are read once that copy's event has completed (``ready``), waiting only if it has not.
    """

    def __init__(self, agreed: torch.Tensor, read_late: bool) -> None:
        self.read_late = read_late
        self.items = agreed[2] if len(agreed) > 2 else None
        agreed = agreed[:2]
        self._event = None
        if agreed.device.type == "cuda":
            host = torch.empty(agreed.shape, dtype=agreed.dtype, pin_memory=True)
            host.copy_(agreed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            agreed = host
        self._host = agreed
        self._values: list[bool] | None = None

    def ready(self) -> bool:
        """Whether reading the values would not wait for the device."""
        return self._event is None or self._event.query()

    def values(self) -> list[bool]:
        """For each flag, whether any rank set it."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()  # only the copy, not the whole device
            self._values = [value > 0 for value in self._host.tolist()]
        return self._values

    @property
    def nonfinite(self) -> bool:
        return self.values()[0]

    @property
    def stop(self) -> bool:
        return self.values()[1]


# The dtypes whose gradient buckets carry a count of items exactly (up to 2**24 in fp32).
_EXACT_DTYPES = (torch.float32, torch.float64)


# DDP checks a hook's annotations against its classes, which this module's postponed
# (string) annotations are not: (agreement, bucket: GradBucket) -> Future[Tensor].
def _all_reduce_with_flags(agreement, bucket):
    """DDP's default all-reduce (divide by the world size, then sum) with the flags appended
    to the step's last bucket; they come back as the number of ranks that set each, and the
    items as their sum over the ranks."""
    buffer = bucket.buffer().div_(agreement.world_size)
    flags = agreement._local if bucket.is_last() else None
    if flags is not None:
        buffer = torch.cat([buffer, flags.to(buffer.dtype)])
    future = dist.all_reduce(buffer, async_op=True).get_future()

    def unpack(done: torch.futures.Future) -> torch.Tensor:
        reduced = done.value()[0]
        if flags is None:
            return reduced
        agreement._agreed = reduced[-len(flags) :]
        return reduced[: -len(flags)]

    return future.then(unpack)
