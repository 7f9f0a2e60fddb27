"""What every rank must agree on after each step: did any rank's loss go non-finite, did the
driver ask to stop. A rank that skipped, stopped or checkpointed at another step than the
others would hang the next collective.

DDP all-reduces the gradients once per optimizer step anyway, so with its default all-reduce
the flags ride along in the step's last gradient bucket (a communication hook): a separate
tiny all-reduce per step costs measurably more (benchmarks/README.md). Where another hook
owns the all-reduce (gradient compression), under torch.compile, FSDP or a single worker,
one tiny all-reduce per step carries them instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class StepAgreement:
    """This rank's flags of a step in, for each flag whether any rank set it out."""

    def __init__(self, model: nn.Module, world_size: int, fuse: bool) -> None:
        self.world_size = world_size
        self._local: torch.Tensor | None = None
        self._agreed: torch.Tensor | None = None
        self.fused = (
            fuse and world_size > 1 and isinstance(model, nn.parallel.DistributedDataParallel)
        )
        if self.fused:
            model.register_comm_hook(self, _all_reduce_with_flags)

    def send(self, flags: torch.Tensor) -> None:
        """This rank's flags (1.0 for yes), before the backward pass of the step's last
        micro-batch: the one in which DDP all-reduces the gradients."""
        self._local, self._agreed = flags, None

    def receive(self) -> list[bool]:
        """For each flag, whether any rank set it; after that backward pass."""
        if self.fused:
            agreed = self._agreed
            if agreed is None:
                raise RuntimeError("DDP's gradient all-reduce did not run in this step")
        else:
            agreed = self._local
            if self.world_size > 1 and dist.is_initialized():
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self._local = self._agreed = None
        return [value > 0 for value in agreed.tolist()]


# DDP checks a hook's annotations against its classes, which this module's postponed
# (string) annotations are not: (agreement, bucket: GradBucket) -> Future[Tensor].
def _all_reduce_with_flags(agreement, bucket):
    """DDP's default all-reduce (divide by the world size, then sum) with the flags appended
    to the step's last bucket; they come back as the number of ranks that set each."""
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
