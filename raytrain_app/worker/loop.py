"""The per-worker training loop: setup, resume, train, validate, checkpoint.

It runs inside every Ray Train worker (or a Tune trial) and talks to its runtime only
through a ``WorkerSession``. Decisions (batch split, precision, lr) come from the plan;
the loop only carries them out. What it trains with is built in ``worker_setup.py``, a
step's math lives in ``step.py``, reporting and checkpoints in ``reporting.py``: read
``WorkerLoop.run`` top to bottom.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raytrain_app import startup_gc
from raytrain_app.checkpoint.sharded import is_sharded
from raytrain_app.checkpoint.train_state import LoopState, Trainables, load_resumable
from raytrain_app.config import RaytrainConfig, config_from_dict
from raytrain_app.errors import RunFailedError
from raytrain_app.logging_setup import quiet_ray_train_worker_logs, setup_logging
from raytrain_app.planning.rules import TrainingPlan, plan_for_world_size
from raytrain_app.protocol import check_counts_hook
from raytrain_app.tracking.metrics_log import MetricsLog
from raytrain_app.tracking.run_files import RankZeroFiles
from raytrain_app.tracking.trackers import SweepTrial, Tracker, open_tracker
from raytrain_app.worker.epoch_data import EpochData
from raytrain_app.worker.fsdp import equal_forwards
from raytrain_app.worker.global_metrics import Averages, Counts, EpochProgress, gather
from raytrain_app.worker.metric_names import MetricNames
from raytrain_app.worker.model_companions import broadcast_buffers
from raytrain_app.worker.rank_zero import is_rank_zero, rank_zero_info, set_rank
from raytrain_app.worker.ray_dataset_batches import RayDataPlan
from raytrain_app.worker.session import RayTrainSession, WorkerSession
from raytrain_app.worker.step import StepOutcome
from raytrain_app.worker.telemetry import StepTelemetry
from raytrain_app.worker.worker_setup import build_worker
from raytrain_app.workloads import FactoryRef

logger = logging.getLogger(__name__)


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
    log_level: int = logging.INFO
    # The driver's RunControl actor (progress in, stop request out), or None without one.
    control: Any = None
    show_progress: bool = False  # rank 0 pushes progress for the driver's bar
    trial: SweepTrial | None = None  # a Tune trial: its sweep, for the trackers
    ray_data: RayDataPlan | None = None  # a data factory's Ray Datasets (driver.ray_datasets)
    data_identity: dict[str, Any] | None = None  # data.path's files (checkpoint.data_identity)
    stream_lanes: int | None = None  # streaming lanes (driver.stream_lanes); None: choose them


def train_worker(task: WorkerTask) -> dict[str, Any]:
    """Ray Train entry point (``train_loop_per_worker``)."""
    return WorkerLoop(task, RayTrainSession()).run()


class WorkerLoop:
    """One worker's run; read ``run`` top to bottom."""

    def __init__(self, task: WorkerTask, session: WorkerSession) -> None:
        self.task = task
        self.session = session
        self.cfg: RaytrainConfig = config_from_dict(task.config)
        self.rank = session.world_rank
        self.world_size = session.world_size
        # An elastic run's workers may be fewer or more than the plan's size: the same
        # global batch, re-split for the workers there are.
        self.plan = plan_for_world_size(task.plan, self.world_size)
        self.state = LoopState()
        self._resumed_epoch: dict[str, Any] | None = None  # this rank's mid-epoch sums
        self._stop = False  # the ranks agreed to checkpoint and stop
        self.metric_names = MetricNames(self.cfg.train.monitor)
        self.tracker = Tracker()  # rank 0's TensorBoard / MLflow / W&B, opened in _run
        self.loaders: EpochData | None = None  # built in setup

    def run(self) -> dict[str, Any]:
        failed = True
        try:
            result = self._run()
            failed = False
            return result
        except SystemExit as exc:  # Tune stopping or pausing a trial at its report: exit(0)
            failed = exc.code not in (0, None)
            raise
        finally:
            startup_gc.resume()  # where no step was taken
            self.tracker.close(failed=failed)
            if self.loaders is not None:  # set up, its reporter too
                self.reporter.close()  # a save in flight ends first (kept if whole)
                self.loaders.shut_down()

    def _run(self) -> dict[str, Any]:
        setup_logging(self.task.log_level)
        quiet_ray_train_worker_logs()
        set_rank(self.rank)
        self.setup()
        self.resume()
        self.state.note_world_size(self.world_size)
        nodes = sorted(set(gather(self.session.node_address(), self.world_size)))
        self.stop_request.confirm_lease()  # before rank 0 writes anything
        # Rank 0 writes its files locally (staged when the run directory is an object store);
        # the tracker uploads them after every epoch and when it closes.
        files = RankZeroFiles(self.task.run_dir, is_rank_zero())
        run_dir = files.local or Path(self.task.run_dir)  # other ranks write nothing there
        metrics_log = MetricsLog(run_dir, self.state.epoch) if is_rank_zero() else None
        tracker = open_tracker(
            self.cfg, run_dir, self.state.step, is_rank_zero(), trial=self.task.trial
        )
        self.tracker = files.tracked(tracker)
        self.telemetry.begin(self.state.step)  # the account of the time starts (goodput)
        for epoch in range(self.state.epoch, self.cfg.train.epochs):
            if self.stopping.stopped_at(self.state.history):  # also after a resume
                break
            row = self.train_epoch(epoch)
            if row is None:  # stopped mid-epoch on request, checkpoint written
                return self._result(nodes, stopped=True)
            with self.telemetry.goodput.timing("validation_s"):
                row.update(self.validate())
            row.update(self.telemetry.goodput.epoch_columns())  # where the time went
            self.metric_names.check_counted(self.spec)
            self.state.epoch, self.state.history = epoch + 1, [*self.state.history, row]
            if metrics_log:
                metrics_log.append(row)
            self.tracker.log_epoch(self.state.step, row)
            self._log_epoch(epoch, row)
            due = self._checkpoint_due(epoch) or self.stopping.checkpoint_due(self.state.history)
            self.report(row, due=due or self._stop)
            if self._stop and epoch + 1 < self.cfg.train.epochs:
                return self._result(nodes, stopped=True)
        return self._result(nodes, stopped=False)

    def _log_epoch(self, epoch: int, row: dict[str, float]) -> None:
        values = ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "epoch")
        rank_zero_info(logger, "epoch %d/%d: %s", epoch + 1, self.cfg.train.epochs, values)

    def _result(self, nodes: list[str], stopped: bool) -> dict[str, Any]:
        """The history, where the workers ran, and the batch split they trained with (the
        memory probe may have changed it)."""
        self.reporter.finish()  # the last checkpoint, maybe saved in the background, is whole
        if stopped:
            rank_zero_info(
                logger, "stopped on request at step %d with a checkpoint", self.state.step
            )
        stopped_early = self.stopping.stopped_at(self.state.history)
        if stopped_early:
            rank_zero_info(
                logger, "stopped early after epoch %d (train.early_stopping)", stopped_early
            )
        return {
            "history": self.state.history,
            **({"stopped_early_at_epoch": stopped_early} if stopped_early else {}),
            "worker_nodes": nodes,
            **({"stopped": True} if stopped else {}),
            "per_worker_batch_size": self.plan.per_worker_batch_size,
            "grad_accum_steps": self.plan.grad_accum_steps,
            "gradient_checkpointing": self.plan.gradient_checkpointing,
            "world_size": self.world_size,
            "world_size_segments": self.state.segments,
            "goodput": self.telemetry.goodput.record(),
            "throughput": self.stepper.throughput.of_run(self.state.history),
        }

    # -- setup ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the data, model and training machinery (``worker.worker_setup``)."""
        parts = build_worker(self.task, self.session, self.cfg, self.plan)
        self.device, self.data_info, self.spec = parts.device, parts.data_info, parts.spec
        self.stop_request, self.reporter = parts.stop_request, parts.reporter
        # The memory probe may have re-split the batch.
        self.plan, self.module, self.loaders = parts.plan, parts.module, parts.loaders
        self.steps_per_epoch = parts.loaders.steps_per_epoch
        self.stepper, self.stopping = parts.stepper, parts.stopping
        self.telemetry = StepTelemetry.for_worker(self.task, self.cfg, parts, self.rank)

    @property
    def model(self) -> nn.Module:
        """The model as trained (DDP-wrapped, compiled)."""
        return self.stepper.model

    @property
    def ema(self) -> Any:
        return self.stepper.ema

    @property
    def _lr(self) -> float | None:
        """The plan's peak lr; None with the model's own configure_optimizers, whose lrs
        stand (on a resume too)."""
        return None if self.spec.configure_optimizers else self.plan.lr

    def _trainables(self) -> Trainables:
        s = self.stepper
        return Trainables(s.model, s.module, s.optimizer, s.scheduler, s.scaler, s.ema, self._lr)

    # -- resume ---------------------------------------------------------------------------
    def resume(self) -> None:
        with self.session.restored_checkpoint() as restored:
            if restored is None:
                return
            # A torn or corrupted newest checkpoint falls back to the next older one.
            resumed = load_resumable(restored, self._trainables(), self._lr, self.device)
        self.state = resumed.state
        self._resumed_epoch = resumed.restore_rank(self.rank, self.world_size)
        rank_zero_info(
            logger,
            "resumed from %s at epoch %d, step %d",
            resumed.directory,
            self.state.epoch + 1 if self.state.step_in_epoch else self.state.epoch,
            self.state.step,
        )

    # -- train ----------------------------------------------------------------------------
    def train_epoch(self, epoch: int) -> dict[str, float] | None:
        """Train one epoch (or its rest, after a mid-epoch resume); None if stopped early."""
        self.model.train()
        plan = self.plan
        first_step = self.state.step_in_epoch
        skip = first_step * plan.grad_accum_steps * plan.per_worker_batch_size
        batches = self.telemetry.goodput.timed(self.loaders.epoch_batches(epoch, skip))
        progress = EpochProgress(self.device, self._resumed_epoch)
        self._resumed_epoch = None
        start = time.perf_counter()
        pending: _PendingFlags | None = None  # the previous step's, read one step late
        for step_in_epoch in range(first_step, self.steps_per_epoch):
            outcome = self.stepper.forward_backward(
                batches, self._stop or self.stop_request.requested()
            )
            self.metric_names.note_step(self.spec, outcome)
            where = self._where(epoch, step_in_epoch)
            if pending is not None:  # its copy finished while this step was queued
                self._settle(pending)
            pending = _PendingFlags(outcome, where)
            # on_nonfinite=skip must know before the update; otherwise the flags are read
            # one step late where reading them waits for the device (step_agreement.py).
            late = outcome.flags.read_late and self.cfg.train.on_nonfinite == "stop"
            if not late:
                self._settle(pending)
                pending = None
            if late or not outcome.flags.nonfinite:
                outcome.add_to(progress)
                self.stepper.apply(self.state.step + 1)
            else:
                self._skip_nonfinite_step(where, outcome)
                progress.skipped_steps += 1
            self.state.step += 1
            self.state.step_in_epoch = step_in_epoch + 1
            self.reporter.prepare(self._trainables)  # once: the checkpoints' host memory
            elapsed = progress.elapsed_s + time.perf_counter() - start
            self.telemetry.after_step(
                self.state, epoch, outcome.last_loss, elapsed, self.tracker, self.stepper.lr
            )
            startup_gc.resume()  # paused while the worker started (PauseOnArrival)
            checkpoint_due = self._step_checkpoint_due()
            if pending is not None and (checkpoint_due or self._stop):  # before any report
                self._settle(pending)
                pending = None
            if self.state.step_in_epoch < self.steps_per_epoch and (self._stop or checkpoint_due):
                progress.elapsed_s += time.perf_counter() - start
                start = time.perf_counter()
                self.report_mid_epoch(progress)
                if self._stop:
                    return None
        if pending is not None:  # before validation and the epoch's report
            self._settle(pending)
        progress.elapsed_s += time.perf_counter() - start
        self.state.step_in_epoch = 0
        return self._epoch_row(epoch, progress)

    def _where(self, epoch: int, step_in_epoch: int) -> str:
        """The step about to be taken, as an error or a log line names it."""
        return (
            f"step {self.state.step + 1} (epoch {epoch + 1}, step {step_in_epoch + 1} of "
            f"{self.steps_per_epoch})"
        )

    def _settle(self, pending: _PendingFlags) -> None:
        """Act on a step's agreed flags, identical on every rank: stop after this step; a
        non-finite loss with on_nonfinite=stop ends the run before any checkpoint."""
        self._stop = self._stop or pending.outcome.flags.stop
        if pending.outcome.flags.nonfinite and self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteLossError(
                f"training loss became non-finite at {pending.where}; lower train.lr, enable "
                f"train.grad_clip, check the data for NaNs, or set train.on_nonfinite=skip"
            )

    def _skip_nonfinite_step(self, where: str, outcome: StepOutcome) -> None:
        rank_zero_info(logger, "skipped %s: non-finite loss %s", where, outcome.losses())
        self.stepper.skip()
        self.state.skipped_steps += 1

    def _step_checkpoint_due(self) -> bool:
        every = self.cfg.train.checkpoint_every_steps
        return bool(every) and self.session.mid_epoch_checkpoints and self.state.step % every == 0

    def _epoch_row(self, epoch: int, progress: EpochProgress) -> dict[str, float]:
        """The epoch's metrics.csv row: exact global means, lr, throughput."""
        row = {
            "epoch": epoch + 1,
            "step": self.state.step,
            **progress.averages.global_means("train_", self.metric_names.means),
            **self._counted("train_", progress.counts),
        }
        row["lr"] = self.stepper.lr()
        row["world_size"] = self.world_size  # an elastic run's size at the epoch's end
        epoch_samples = self.steps_per_epoch * self.plan.effective_batch_size
        row.update(self.stepper.throughput.epoch_fields(progress, epoch_samples, self.world_size))
        if self.cfg.train.on_nonfinite == "skip":
            # Every rank skipped the same steps (they agree after each step).
            row["skipped_steps"] = progress.skipped_steps
        return row

    # -- validate -------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        # The bare module: DDP's forward would sync buffers, and ranks run different
        # numbers of validation batches (FSDP's module is the sharded model itself).
        module = self._validation_module()  # the EMA weights once averaging has begun
        # Every rank validates with rank 0's buffers, the ones its checkpoint holds.
        broadcast_buffers(module, self.world_size)
        module.eval()
        averages, counts = Averages(self.device), Counts(self.device)
        # A sharded (FSDP) model's forward is collective: every rank runs as many.
        val = equal_forwards(self.loaders.val, is_sharded(module), self.device)
        for batch, real in val:
            with self.stepper.autocast():
                out = self.spec.step(module, batch)
            if real:  # not a sharded model's repeated forward
                averages.add({"loss": out.mean_loss, **out.metrics}, out.num_samples)
                check_counts_hook(self.spec, out.counts)
                counts.add(out.counts)
        # A rank with no validation samples still joins the reduces, with zeros.
        means = averages.global_means("val_", self.metric_names.means)
        return {**means, **self._counted("val_", counts)}

    def _counted(self, prefix: str, counts: Counts) -> dict[str, float]:
        return self.metric_names.counted(self.spec, prefix, counts, self.world_size)

    def _validation_module(self) -> nn.Module:
        if self.ema is not None and int(self.ema.n_averaged) > 0:
            return self.ema.module
        return self.module

    # -- checkpoint and report -------------------------------------------------------------
    def _checkpoint_due(self, epoch: int) -> bool:
        every = self.cfg.train.checkpoint_every_epochs
        return (epoch + 1) % every == 0 or epoch + 1 == self.cfg.train.epochs

    def report(self, row: dict[str, float], due: bool) -> None:
        """Report the epoch on every rank (Ray requires equal counts); rank 0 checkpoints."""
        progress = EpochProgress(self.device)
        with self.telemetry.reporting(due):  # the time a checkpoint blocks is counted
            self.reporter.report(row, due, self.state, self._trainables(), progress)

    def report_mid_epoch(self, progress: EpochProgress) -> None:
        """A checkpoint between two steps, with what the rest of the epoch needs to resume."""
        row = {"epoch": self.state.epoch, "step": self.state.step, "mid_epoch": 1}
        with self.telemetry.reporting(True):
            self.reporter.report(row, True, self.state, self._trainables(), progress)


@dataclass
class _PendingFlags:
    """A step's outcome whose agreed flags the loop has yet to act on, and where it was."""

    outcome: StepOutcome
    where: str
