"""Find the largest micro-batch that fits the GPU (``train.max_batch_per_worker: auto``).

The probe runs forward and backward of the real model on real samples, halving the
micro-batch on out-of-memory, while a reserve is held for what training adds later
(``training_state_bytes``: the optimizer's state, measured on the optimizer the run
builds, the gradients, DDP's gradient buckets and the EMA's copy of the weights, plus
headroom for torch.compile) and, on a GPU shared with other trials (a fractional
``scaling.gpus_per_worker``), for the memory beyond this worker's share. The plan then
keeps the global batch with gradient accumulation, so the optimisation is the same
whatever fits.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.config import TrainConfig
from raytrain_app.errors import RunFailedError
from raytrain_app.planning.batch import plan_batch
from raytrain_app.planning.rules import TrainingPlan
from raytrain_app.protocol import CollateFn, ModelSpec, collate
from raytrain_app.worker.rank_zero import rank_zero_info
from raytrain_app.worker.recipe import build_optimizer
from raytrain_app.worker.session import to_device

logger = logging.getLogger(__name__)

# A model's own configure_optimizers builds its optimizer only once the run's length is
# known, after the probe: its state is taken to be Adam's two moments, the common case.
_HOOK_OPTIMIZER_STATE = 2.0
# torch.compile trains a graph the eager probe never ran: Inductor's fusions can keep
# more activations alive than eager does (pytorch/pytorch#135305), and its kernels load
# onto the device at the first step. Held back besides: this share of the memory the
# probe would otherwise leave for the batch.
_COMPILE_HEADROOM = 0.1


def largest_fitting(try_micro_batch: Callable[[int], None], upper: int) -> int:
    """The largest of ``upper, upper/2, ..., 1`` for which ``try_micro_batch`` runs
    without running out of device memory."""
    size = upper
    while size >= 1:
        try:
            try_micro_batch(size)
            return size
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            logger.debug("micro-batch %d does not fit", size)
            size //= 2
    raise RunFailedError(
        "not even a micro-batch of 1 sample fits in the GPU's memory; set "
        "optimizations.gradient_checkpointing=true, use precision bf16/fp16, or a smaller model"
    )


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_per_param_byte(
    spec: ModelSpec, train: TrainConfig, plan: TrainingPlan
) -> float:
    """Bytes of state the run's optimizer keeps per parameter byte, measured: the optimizer
    ``train.optimizer`` names, built as the workers build it over a stand-in parameter on
    the CPU and stepped once (AdamW keeps 2, Adam with amsgrad 3, SGD with momentum 1,
    without it 0). Scalars per tensor (Adam's step count) are left out."""
    if spec.configure_optimizers is not None:
        return _HOOK_OPTIMIZER_STATE
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.zeros(1024))
    # fused=True changes how the state is updated, not its size, and needs the GPU.
    optimizer = build_optimizer(holder, train, replace(plan, fused_optimizer=False))
    holder.weight.grad = torch.ones_like(holder.weight)
    optimizer.step()
    kept = [t for t in optimizer.state[holder.weight].values() if isinstance(t, torch.Tensor)]
    return _bytes(t for t in kept if t.dim() > 0) / _bytes([holder.weight])


def training_state_bytes(module: nn.Module, plan: TrainingPlan, optimizer_state: float) -> int:
    """Device memory training adds to what the probe measures, for ``module`` trained as
    ``plan`` says with an optimizer keeping ``optimizer_state`` bytes per parameter byte:

    - the optimizer's state, created at the first step;
    - the gradients: the probe frees its own after every try, training keeps them from a
      backward pass to the optimizer's step, through the forward passes of the next
      micro-batches under accumulation;
    - DDP's gradient buckets (more than one worker), a copy of every gradient;
    - with ``train.ema``, the EMA's copy of every parameter and buffer (``AveragedModel``
      deep-copies the module).
    """
    param_bytes = _bytes(module.parameters())
    buckets = 1.0 if plan.strategy == "ddp" and plan.world_size > 1 else 0.0
    ema_bytes = param_bytes + _bytes(module.buffers()) if plan.ema_decay is not None else 0
    return int(param_bytes * (optimizer_state + 1.0 + buckets)) + ema_bytes


def probe_reserve(
    state_bytes: int,
    share: float,
    free_bytes: int,
    total_bytes: int,
    used_bytes: int,
    compiled: bool,
) -> int:
    """Bytes the probe holds on the GPU while it tries micro-batches.

    Args:
        state_bytes: what training adds after the probe (``training_state_bytes``).
        share: the GPUs Ray reserved for this worker (``scaling.gpus_per_worker``); below
            1, other trials train on the same GPU, so the free memory beyond this worker's
            share of ``total_bytes`` is held too.
        free_bytes, total_bytes: the GPU's free and total memory now.
        used_bytes: what this process holds already (the model's weights).
        compiled: the model trains under torch.compile (``_COMPILE_HEADROOM``).
    """
    beyond_share = free_bytes - (min(share, 1.0) * total_bytes - used_bytes)
    held = state_bytes + max(beyond_share, 0)
    if compiled:
        held += max(free_bytes - held, 0) * _COMPILE_HEADROOM
    return int(held)


def _held_bytes(
    module: nn.Module, plan: TrainingPlan, device: torch.device, optimizer_state: float
) -> int:
    """``probe_reserve`` for ``module`` on ``device`` as it is now (0 off CUDA).

    Raises:
        RunFailedError: the reserve leaves no memory for a single micro-batch.
    """
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    state = training_state_bytes(module, plan, optimizer_state)
    used = torch.cuda.memory_reserved(device)
    held = probe_reserve(state, plan.gpus_per_worker, free, total, used, plan.compile)
    if held >= free:
        raise RunFailedError(
            f"the model's training state ({state / 2**30:.1f} GiB with optimizer state, "
            f"gradients and any EMA) leaves no memory for a batch within "
            f"scaling.gpus_per_worker={plan.gpus_per_worker:g} of the GPU; raise "
            f"scaling.gpus_per_worker, set train.ema.enabled=false, or use a smaller model"
        )
    return held


@contextlib.contextmanager
def _reserve(nbytes: int, device: torch.device) -> Iterator[None]:
    """Hold ``nbytes`` of ``device``'s memory while the block runs (nothing off CUDA)."""
    if device.type != "cuda":
        yield
        return
    held = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        yield
    finally:
        del held
        torch.cuda.empty_cache()


def probe_micro_batch(
    spec: ModelSpec,
    module: nn.Module,
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    to_device: Callable[[Any], Any],
    upper: int,
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> int:
    """The largest micro-batch (at most ``upper``) whose forward and backward fit.

    Runs no collective (each rank probes alone; ``fit_plan_to_memory`` agrees afterwards)
    and leaves ``module`` as it found it: its mode, every buffer (BatchNorm's running
    statistics, which the probe's train-mode forwards update) and its parameters' grads.
    """
    was_training = module.training
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    grads = [(p, p.grad) for p in module.parameters()]
    module.train()

    def try_micro_batch(size: int) -> None:
        batch = to_device(collate([dataset[i % len(dataset)] for i in range(size)]))
        try:
            with autocast():
                loss = spec.step(module, batch).loss
            loss.backward()
        finally:
            module.zero_grad(set_to_none=True)

    # The probe's draws (dropout) must not shift the training's random streams.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        fits = largest_fitting(try_micro_batch, upper)
    module.train(was_training)
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    for param, grad in grads:
        param.grad = grad
    return fits


def fit_plan_to_memory(
    plan: TrainingPlan,
    spec: ModelSpec,
    module: nn.Module,
    train_set: Any,
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
    world_size: int,
    train: TrainConfig,
    collate: CollateFn = collate,
) -> TrainingPlan:
    """``plan`` with the largest micro-batch that fits on every rank (the smallest over
    all ranks, agreed in one all-reduce after each rank probed alone) and the global batch
    kept with accumulation. Gradient checkpointing is turned on first when it is ``auto``,
    the batch does not fit, and the model supports it.

    Runs on every rank before SyncBatchNorm and DDP touch the bare ``module``; the probe's
    batches are ``train_set``'s first samples, batched by the workload's ``collate``.
    """
    module.to(device)
    state = optimizer_state_per_param_byte(spec, train, plan)  # train.optimizer's

    def probe() -> int:
        fits = probe_micro_batch(
            spec,
            module,
            train_set,
            collate,
            lambda batch: to_device(batch, device),
            plan.per_worker_batch_size,
            autocast,
            device,
        )
        fits_everywhere = torch.tensor(float(fits), device=device)
        if world_size > 1 and dist.is_initialized():
            dist.all_reduce(fits_everywhere, op=dist.ReduceOp.MIN)
        return int(fits_everywhere.item())

    checkpointing = plan.gradient_checkpointing
    hook = getattr(module, "gradient_checkpointing_enable", None)
    with _reserve(_held_bytes(module, plan, device, state), device):
        fits = probe()
        if fits < plan.per_worker_batch_size and plan.gradient_checkpointing_auto and hook:
            hook()
            checkpointing = True
            fits = probe()
    split = plan_batch(plan.effective_batch_size, plan.world_size, fits)
    with_checkpointing = " with gradient checkpointing" if checkpointing else ""
    rank_zero_info(
        logger,
        "memory probe: micro-batch %d fits%s; %d x %d accumulation keeps the global batch %d",
        *(fits, with_checkpointing, split.micro_batch, split.accum_steps, split.global_batch),
    )
    return replace(
        plan,
        per_worker_batch_size=split.micro_batch,
        grad_accum_steps=split.accum_steps,
        gradient_checkpointing=checkpointing,
        max_batch_per_worker=fits,
    )
