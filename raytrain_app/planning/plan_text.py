"""``raytrain plan`` for people: the plan, one line per decision, with its reason.

``raytrain plan --json`` prints ``TrainingPlan.to_dict()`` instead.
"""

from __future__ import annotations

from typing import Any

from raytrain_app.planning.environment import Environment
from raytrain_app.planning.rules import TrainingPlan, plan_for_world_size


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _kept(keep: int | None) -> str:
    return "every checkpoint, best" if keep is None else f"the {keep} best"


def _workers(plan) -> str:
    if plan.worker_range is None:
        return str(plan.world_size)
    low, high = plan.worker_range
    return f"{low} to {high} (elastic)"


def _elastic_lines(plan) -> list[str]:
    """Each size an elastic run may have, with its split (the ends only for long ranges)."""
    if plan.worker_range is None:
        return []
    low, high = plan.worker_range
    sizes = range(low, high + 1) if high - low < 6 else (low, high)
    splits = []
    for size in sizes:
        sized = plan_for_world_size(plan, size)
        splits.append(f"{size} x {sized.per_worker_batch_size} x {sized.grad_accum_steps}")
    return [
        f"elastic     : workers x micro-batch x accumulation = {', '.join(splits)}; global "
        f"batch {plan.effective_batch_size} at every size; a resize restarts from the newest "
        f"checkpoint"
    ]


def format_plan(env: Environment, plan: TrainingPlan) -> str:
    r = env.resources
    gpu = (
        f", GPU {env.gpu.name} (cc {env.gpu.capability[0]}.{env.gpu.capability[1]})"
        if env.gpu
        else ""
    )
    return "\n".join(
        [
            f"environment : {env.platform}, python {env.python}, torch {env.torch_version}, "
            f"launcher {env.launcher}",
            f"resources   : {r.cpus:g} CPUs, {r.gpus:g} GPUs, {r.nodes} node(s) ({r.source}){gpu}",
            f"workers     : {_workers(plan)} on {plan.device} ({plan.cpus_per_worker:g} CPU"
            + (f", {plan.gpus_per_worker:g} GPU" if plan.use_gpu else "")
            + " each)"
            + ("" if plan.fits else "; more than can be hosted now (see the warning above)"),
            f"batch       : {plan.per_worker_batch_size} per worker x {plan.world_size} workers x "
            f"{plan.grad_accum_steps} accumulation = {plan.effective_batch_size} effective"
            + (", micro-batch probed on the GPUs at start" if plan.memory_probe else ""),
            *_elastic_lines(plan),
            f"precision   : {plan.precision}"
            + (" + GradScaler" if plan.grad_scaler else "")
            + (", TF32 matmul" if plan.tf32 else ""),
            f"mfu         : {plan.mfu_peak}",
            f"distributed : {plan.strategy} over {plan.backend}, timeout {plan.timeout_s}s, "
            f"SyncBatchNorm {'on' if plan.sync_batchnorm else 'off'}, "
            f"gradient compression {plan.grad_compression}",
            f"speed/memory: torch.compile {_on(plan.compile)}, fused optimizer "
            f"{_on(plan.fused_optimizer)}, gradient checkpointing "
            + (
                "auto (on if the probed micro-batch is too small)"
                if plan.gradient_checkpointing_auto
                else _on(plan.gradient_checkpointing)
            ),
            "weights     : "
            + (
                f"EMA with decay {plan.ema_decay:g} from step {plan.ema_start_step}, "
                "used for validation"
                if plan.ema_decay is not None
                else "no EMA"
            ),
            f"optimizer   : {plan.optimizer}",
            f"lr          : {plan.lr:.4g} (base {plan.base_lr:.4g}, scaling {plan.lr_scaling}), "
            f"{plan.schedule}" + _floor(plan),
            f"stopping    : early stopping on {plan.monitor} ({plan.early_stopping})"
            if plan.early_stopping
            else "stopping    : after train.epochs (no early stopping)",
            f"dataloader  : {plan.dataloader_workers} loader processes per worker, "
            f"pin_memory {plan.pin_memory}",
            f"checkpoints : keep {_kept(plan.keep_checkpoints)} by {plan.monitor} "
            f"({plan.monitor_mode}) and always the newest; a resume continues from the newest",
            "tracking    : metrics.csv (rank 0)" + "".join(f", {name}" for name in plan.tracking),
            *(f"note        : {note}" for note in plan.notes),
        ]
    )


def _floor(plan: Any) -> str:
    """Where cosine and linear decay end."""
    return f" to {plan.min_lr_ratio:g}x" if plan.schedule.endswith(("cosine", "linear")) else ""
