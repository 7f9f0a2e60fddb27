"""The per-worker training loop: setup, resume, train, validate, checkpoint.

It runs inside every Ray Train worker (or a Tune trial) and talks to its runtime only
through a ``WorkerSession``. Decisions (batch split, precision, lr) come from the plan;
the loop only carries them out.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain_app import checkpoint as ckpt
from raytrain_app.config import RaytrainConfig, config_from_dict
from raytrain_app.errors import RunFailedError
from raytrain_app.global_metrics import Averages, EpochProgress, gather
from raytrain_app.logging_setup import quiet_ray_train_worker_logs, setup_logging
from raytrain_app.memory_probe import fit_plan_to_memory
from raytrain_app.metrics_log import MetricsLog
from raytrain_app.model_companions import broadcast_buffers, make_ema, register_comm_hook
from raytrain_app.monitor import SCORE_KEY, check_monitor, checkpoint_score
from raytrain_app.plan import TrainingPlan, lr_factor, steps_per_epoch
from raytrain_app.protocol import ModelSpec
from raytrain_app.rank_zero import is_rank_zero, rank_zero_info, set_rank
from raytrain_app.session import RayTrainSession, WorkerSession, scratch_dir
from raytrain_app.step_agreement import StepAgreement
from raytrain_app.sync_batchnorm import convert_sync_batchnorm, has_batchnorm
from raytrain_app.tracking import Tracker, open_tracker
from raytrain_app.train_state import LoopState, Trainables, load_resumable, save_resumable
from raytrain_app.worker_loaders import WorkerLoaders, build_worker_loaders
from raytrain_app.workloads import FactoryRef, build_data, build_model

logger = logging.getLogger(__name__)

# How often rank 0 pushes a progress update to the driver; cheap, fire-and-forget.
_PROGRESS_INTERVAL_S = 0.5
# How often rank 0 looks for the driver's stop request (a file); the answer reaches the
# other ranks through the per-step agreement, so all stop at the same step.
_STOP_POLL_INTERVAL_S = 0.5


class NonFiniteLossError(RunFailedError):
    """The loss became NaN or infinite; the run stops without checkpointing it."""


@dataclass
class WorkerTask:
    """Everything a worker needs, prepared by the driver (picklable)."""

    config: dict[str, Any]
    plan: TrainingPlan
    data: FactoryRef
    model: FactoryRef
    run_dir: str
    progress: Any = None  # a ProgressTracker actor handle, or None
    log_level: int = logging.INFO
    stop_file: str | None = None  # the driver creates it to ask for a checkpoint and a stop


def train_worker(task: WorkerTask) -> dict[str, Any]:
    """Ray Train entry point (``train_loop_per_worker``)."""
    return WorkerLoop(task, RayTrainSession()).run()


class WorkerLoop:
    """One worker's run; read ``run`` top to bottom."""

    def __init__(self, task: WorkerTask, session: WorkerSession) -> None:
        self.task = task
        self.session = session
        self.plan = task.plan
        self.cfg: RaytrainConfig = config_from_dict(task.config)
        self.rank = session.world_rank
        self.world_size = session.world_size
        self.state = LoopState()
        self._metric_names: list[str] = []
        self._resumed_epoch: dict[str, Any] | None = None  # this rank's mid-epoch sums
        self._stop = False  # the driver asked for a checkpoint and a stop
        self._last_stop_poll = 0.0
        self.tracker = Tracker()  # rank 0's TensorBoard / MLflow / W&B, opened in _run
        self._monitor_checked = False
        self.loaders: WorkerLoaders | None = None  # built in setup

    def run(self) -> dict[str, Any]:
        failed = True
        try:
            result = self._run()
            failed = False
            return result
        finally:
            self.tracker.close(failed=failed)
            if self.loaders is not None:
                self.loaders.shut_down()

    def _run(self) -> dict[str, Any]:
        setup_logging(self.task.log_level)
        quiet_ray_train_worker_logs()
        set_rank(self.rank)
        self.setup()
        self.resume()
        nodes = sorted(set(gather(self.session.node_address(), self.world_size)))
        metrics_log = (
            MetricsLog(Path(self.task.run_dir), self.state.epoch) if is_rank_zero() else None
        )
        self.tracker = open_tracker(
            self.cfg, Path(self.task.run_dir), self.state.step, is_rank_zero()
        )
        for epoch in range(self.state.epoch, self.cfg.train.epochs):
            row = self.train_epoch(epoch)
            if row is None:  # stopped mid-epoch on request, checkpoint written
                return self._stopped_result(nodes)
            row.update(self.validate())
            self.state.epoch, self.state.history = epoch + 1, [*self.state.history, row]
            if metrics_log:
                metrics_log.append(row)
            self.tracker.log_epoch(self.state.step, row)
            rank_zero_info(
                logger,
                "epoch %d/%d: %s",
                epoch + 1,
                self.cfg.train.epochs,
                ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "epoch"),
            )
            self.report(row, due=self._checkpoint_due(epoch) or self._stop)
            if self._stop and epoch + 1 < self.cfg.train.epochs:
                return self._stopped_result(nodes)
        return {"history": self.state.history, "worker_nodes": nodes, **self._split()}

    def _split(self) -> dict[str, Any]:
        """The batch split this run trained with (the memory probe may have changed it)."""
        return {
            "per_worker_batch_size": self.plan.per_worker_batch_size,
            "grad_accum_steps": self.plan.grad_accum_steps,
            "gradient_checkpointing": self.plan.gradient_checkpointing,
        }

    def _stopped_result(self, nodes: list[str]) -> dict[str, Any]:
        rank_zero_info(logger, "stopped on request at step %d with a checkpoint", self.state.step)
        return {
            "history": self.state.history,
            "worker_nodes": nodes,
            "stopped": True,
            **self._split(),
        }

    # -- setup ---------------------------------------------------------------------------
    def setup(self) -> None:
        plan, cfg = self.plan, self.cfg
        torch.set_num_threads(max(1, int(plan.cpus_per_worker)))
        if plan.tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.device = self.session.device()
        seed = cfg.experiment.seed
        splits = build_data(self.task.data, seed)
        self.data_info = dict(splits.info)
        # Same seed on every rank and for every world size: identical initial weights.
        torch.manual_seed(seed)
        self.spec: ModelSpec = build_model(self.task.model, self.data_info)
        self.module = self.spec.module
        if plan.sync_batchnorm and has_batchnorm(self.module):
            # Before DDP wraps it; the converted layers keep BatchNorm's state-dict keys.
            self.module = convert_sync_batchnorm(self.module, self.device)
            rank_zero_info(logger, "BatchNorm layers synchronised across workers (SyncBatchNorm)")
        if plan.gradient_checkpointing:  # the driver checked the model has the hook
            self.module.gradient_checkpointing_enable()
        if plan.memory_probe:
            self.plan = plan = fit_plan_to_memory(
                plan,
                self.spec,
                self.module,
                splits.train,
                self._autocast,
                self.device,
                self.world_size,
            )
        self.model = self.session.prepare_model(
            self.module,
            plan.strategy,
            {"find_unused_parameters": cfg.distributed.find_unused_parameters}
            if plan.strategy == "ddp"
            else {},
        )
        register_comm_hook(
            self.model,
            plan.grad_compression,
            cfg.distributed.powersgd_rank,
            cfg.distributed.start_powersgd_iter,
        )
        # The per-step flags ride on DDP's gradient all-reduce unless a hook owns it.
        fuse = plan.grad_compression == "none" and not plan.compile
        self.agreement = StepAgreement(self.model, self.world_size, fuse)
        self.ema = make_ema(self.module, plan.ema_decay)
        if plan.compile:
            # Compiles the DDP-wrapped model, so Dynamo splits graphs at DDP's buckets;
            # checkpoints store the plain module's state_dict (no "_orig_mod.").
            self.model = torch.compile(self.model)
        self.loaders = build_worker_loaders(
            splits.train,
            splits.val,
            plan,
            cfg.dataloader,
            seed=seed,
            rank=self.rank,
            world_size=self.world_size,
            prepare=self.session.prepare_loader,
        )
        self.steps_per_epoch = steps_per_epoch(len(splits.train), plan.effective_batch_size)
        self.total_steps = self.steps_per_epoch * cfg.train.epochs
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, plan.warmup_steps, self.total_steps, plan.min_lr_ratio),
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=plan.grad_scaler)
        # Dropout and other runtime randomness differ per rank, as independent replicas should.
        self._seed_runtime_rng(seed + 1 + self.rank)
        rank_zero_info(logger, "plan: %s", self._plan_line(len(splits.train), len(splits.val)))

    def _plan_line(self, n_train: int, n_val: int) -> str:
        p = self.plan
        params = sum(t.numel() for t in self.module.parameters())
        return (
            f"{p.world_size} worker(s) x micro-batch {p.per_worker_batch_size} x accumulation "
            f"{p.grad_accum_steps} = global batch {p.effective_batch_size}; {p.precision} on "
            f"{p.device}, {p.backend}, {p.strategy}; lr {p.lr:.3g}; {params:,} parameters; "
            f"{n_train:,} train / {n_val:,} val samples; {self.steps_per_epoch} steps per epoch"
        )

    @staticmethod
    def _seed_runtime_rng(seed: int) -> None:
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)

    def _optimizer(self) -> torch.optim.Optimizer:
        train = self.cfg.train
        params = [p for p in self.model.parameters() if p.requires_grad]
        if train.optimizer == "sgd":
            return torch.optim.SGD(
                params, lr=self.plan.lr, momentum=0.9, weight_decay=train.weight_decay
            )
        optimizer_cls = torch.optim.AdamW if train.optimizer == "adamw" else torch.optim.Adam
        fused = {"fused": True} if self.plan.fused_optimizer else {}
        return optimizer_cls(params, lr=self.plan.lr, weight_decay=train.weight_decay, **fused)

    def _validation_module(self) -> nn.Module:
        if self.ema is not None and int(self.ema.n_averaged) > 0:
            return self.ema.module
        return self.module

    # -- resume ---------------------------------------------------------------------------
    def resume(self) -> None:
        with self.session.restored_checkpoint() as restored:
            if restored is None:
                return
            # A torn or corrupted newest checkpoint falls back to the next older one.
            resumed = load_resumable(restored, self._trainables(), self.plan.lr, self.device)
        self.state = resumed.state
        self._resumed_epoch = resumed.restore_rank(self.rank, self.world_size)
        rank_zero_info(
            logger,
            "resumed from %s at epoch %d, step %d",
            resumed.directory,
            self.state.epoch + 1 if self.state.step_in_epoch else self.state.epoch,
            self.state.step,
        )

    def _trainables(self) -> Trainables:
        return Trainables(
            self.model, self.module, self.optimizer, self.scheduler, self.scaler, self.ema
        )

    # -- train ----------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.plan.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Gradients are all-reduced only on the last micro-step of an accumulation window.
        if not last_micro_step and isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_epoch(self, epoch: int) -> dict[str, float] | None:
        """Train one epoch (or its rest, after a mid-epoch resume); None if stopped early."""
        self.model.train()
        plan = self.plan
        accum = plan.grad_accum_steps
        first_step = self.state.step_in_epoch
        batches = self.loaders.epoch_batches(epoch, first_step * accum * plan.per_worker_batch_size)
        progress = EpochProgress(self.device, self._resumed_epoch)
        self._resumed_epoch = None
        start = last_push = time.perf_counter()
        for step_in_epoch in range(first_step, self.steps_per_epoch):
            micro_results = []
            for micro in range(accum):
                last = micro == accum - 1
                with self._sync_context(last):
                    with self._autocast():
                        out = self.spec.step(self.model, next(batches))
                    micro_results.append(({"loss": out.loss, **out.metrics}, out.num_samples))
                    if last:  # the flags travel with this backward's gradient all-reduce
                        self.agreement.send(self._step_flags(micro_results))
                    self.scaler.scale(out.loss / accum).backward()
            if not self._monitor_checked:  # the first step tells which metrics the model has
                check_monitor(self.cfg.train.monitor, list(out.metrics))
                self._monitor_checked = True
            self._metric_names = list(out.metrics)
            nonfinite, self._stop = self.agreement.receive()
            if nonfinite:
                self._skip_nonfinite_step(epoch, step_in_epoch, micro_results)
                progress.skipped_steps += 1
            else:
                for values, num_samples in micro_results:
                    progress.averages.add(values, num_samples)
                self._optimizer_step()
            self.state.step_in_epoch = step_in_epoch + 1
            if self.tracker.due(self.state.step):
                lr = self.scheduler.get_last_lr()[0]
                self.tracker.log_step(self.state.step, {"loss": float(out.loss.detach()), "lr": lr})
            now = time.perf_counter()
            if (
                self.task.progress is not None
                and is_rank_zero()
                and (
                    now - last_push >= _PROGRESS_INTERVAL_S
                    or step_in_epoch + 1 == self.steps_per_epoch
                )
            ):
                last_push = now
                # The epoch's training time so far: the part before a mid-epoch checkpoint
                # (or before a resume) included, as the step count is.
                elapsed = progress.elapsed_s + now - start
                self._push_progress(epoch, step_in_epoch + 1, out.loss, elapsed)
            if step_in_epoch + 1 < self.steps_per_epoch and (
                self._stop or self._step_checkpoint_due()
            ):
                progress.elapsed_s += time.perf_counter() - start
                start = time.perf_counter()
                self.report_mid_epoch(progress)
                if self._stop:
                    return None
        progress.elapsed_s += time.perf_counter() - start
        self.state.step_in_epoch = 0
        row = {
            "epoch": epoch + 1,
            "step": self.state.step,
            **progress.averages.global_means("train_", self._metric_names),
        }
        row["lr"] = self.scheduler.get_last_lr()[0]
        # elapsed_s is the whole epoch's training time, the part before a resume included
        # (without the time lost to the interruption), so the rate is over all its steps.
        epoch_samples = self.steps_per_epoch * plan.effective_batch_size
        row["samples_per_s"] = epoch_samples / max(progress.elapsed_s, 1e-9)
        row["epoch_time_s"] = progress.elapsed_s
        if self.cfg.train.on_nonfinite == "skip":
            # Every rank skipped the same steps (they agree after each step).
            row["skipped_steps"] = progress.skipped_steps
        return row

    def _step_flags(self, micro_results: list) -> torch.Tensor:
        """This rank's view of the step: [a loss was non-finite, the driver asked to stop].

        Every rank then skips, stops or checkpoints at the same step (``StepAgreement``).
        """
        losses = torch.stack([values["loss"].detach().float() for values, _ in micro_results])
        stop = float(self._stop_requested())
        return torch.stack(
            [(~torch.isfinite(losses).all()).float(), torch.tensor(stop, device=losses.device)]
        )

    def _stop_requested(self) -> bool:
        if self._stop:
            return True
        if not (is_rank_zero() and self.task.stop_file):
            return False
        now = time.monotonic()
        if now - self._last_stop_poll < _STOP_POLL_INTERVAL_S:
            return False
        self._last_stop_poll = now
        return Path(self.task.stop_file).exists()

    def _skip_nonfinite_step(self, epoch: int, step_in_epoch: int, micro_results: list) -> None:
        losses = [float(values["loss"].detach()) for values, _ in micro_results]
        where = (
            f"step {self.state.step + 1} (epoch {epoch + 1}, step {step_in_epoch + 1} of "
            f"{self.steps_per_epoch})"
        )
        if self.cfg.train.on_nonfinite == "stop":
            # Raised on every rank before the optimizer step and before any checkpoint.
            raise NonFiniteLossError(
                f"training loss became non-finite at {where}; lower train.lr, enable "
                f"train.grad_clip, check the data for NaNs, or set train.on_nonfinite=skip"
            )
        rank_zero_info(logger, "skipped %s: non-finite loss %s", where, losses)
        self.optimizer.zero_grad(set_to_none=True)
        # The schedule follows the data: a skipped step still advances it.
        self.scheduler.step()
        self.state.step += 1
        self.state.skipped_steps += 1

    def _step_checkpoint_due(self) -> bool:
        every = self.cfg.train.checkpoint_every_steps
        return bool(every) and self.session.mid_epoch_checkpoints and self.state.step % every == 0

    def _optimizer_step(self) -> None:
        if self.cfg.train.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.step += 1
        if self.ema is not None and self.state.step > self.plan.ema_start_step:
            # Buffers (BatchNorm statistics) are per rank until DDP's next forward: take
            # rank 0's, so the averaged buffers stay identical on every rank.
            broadcast_buffers(self.module, self.world_size)
            self.ema.update_parameters(self.module)  # the first update copies the weights

    def _push_progress(self, epoch: int, step: int, loss: torch.Tensor, elapsed: float) -> None:
        self.task.progress.update.remote(
            epoch=epoch + 1,
            epochs=self.cfg.train.epochs,
            step=step,
            steps=self.steps_per_epoch,
            loss=float(loss.detach()),
            samples_per_s=step * self.plan.effective_batch_size / max(elapsed, 1e-9),
        )

    # -- validate -------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        # The bare module: DDP's forward would sync buffers, and ranks run different
        # numbers of validation batches.
        module = self._validation_module()  # the EMA weights once averaging has begun
        # Every rank validates with rank 0's buffers, the ones its checkpoint holds.
        broadcast_buffers(module, self.world_size)
        module.eval()
        averages = Averages(self.device)
        for batch in self.loaders.val:
            with self._autocast():
                out = self.spec.step(module, batch)
            averages.add({"loss": out.loss, **out.metrics}, out.num_samples)
        # A rank with no validation samples still joins the reduce, with zeros.
        return averages.global_means("val_", self._metric_names)

    # -- checkpoint and report -------------------------------------------------------------
    def _checkpoint_due(self, epoch: int) -> bool:
        every = self.cfg.train.checkpoint_every_epochs
        return (epoch + 1) % every == 0 or epoch + 1 == self.cfg.train.epochs

    def report(self, row: dict[str, float], due: bool) -> None:
        """Report the epoch on every rank (Ray requires equal counts); rank 0 checkpoints."""
        self._report(row, due, EpochProgress(self.device))

    def report_mid_epoch(self, progress: EpochProgress) -> None:
        """A checkpoint between two steps, with what the rest of the epoch needs to resume."""
        row = {"epoch": self.state.epoch, "step": self.state.step, "mid_epoch": 1}
        self._report(row, True, progress)

    def _report(self, row: dict[str, float], due: bool, progress: EpochProgress) -> None:
        per_rank = {"rng": ckpt.rng_state(), "epoch": progress.to_dict()} if due else None
        ranks = gather(per_rank, self.world_size) if due else None
        name = ckpt.checkpoint_name(self.state.epoch, self.state.step) if due else None
        # Ray ranks checkpoints by this score (train.monitor / train.mode); see monitor.py.
        train = self.cfg.train
        reported = {**row, SCORE_KEY: checkpoint_score(row, train.monitor, train.mode)}
        if not (due and is_rank_zero()):
            self.session.report(reported, None, name)
            return
        with scratch_dir() as directory:
            save_resumable(
                directory,
                self._trainables(),
                self.state,
                ranks,
                meta={
                    "model_factory": asdict(self.task.model),
                    "data_factory": asdict(self.task.data),
                    "data_info": self.data_info,
                    "config": self.task.config,
                    "epoch": self.state.epoch,
                    "step": self.state.step,
                    "metrics": row,
                },
            )
            self.session.report(reported, directory, name)
