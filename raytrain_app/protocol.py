"""The contract between raytrain and a workload: what model and data factories return.

A workload is two importable factories, named in the config as ``model.target`` and
``data.target`` (``"my_pkg.models:build"``). The built-in wind forecaster uses exactly the
same protocol, so anything it can do, a user's workload can do.

Data factory::

    def build_data(params: dict, seed: int) -> DataSplits

It runs inside every training worker and must be deterministic for a given ``seed``.
It returns map-style ``torch.utils.data.Dataset`` objects; raytrain wraps them in
DataLoaders with a ``DistributedSampler`` and splits the batch. ``info`` carries whatever
the model needs to size itself (number of features, horizon, normalisation statistics)
and is saved in every checkpoint, so ``load_model`` can rebuild the model without data.

Epoch hook (optional)::

    def set_epoch(self, epoch: int) -> None

If the training dataset has it, raytrain calls it at the start of every epoch (and of a
resumed one), before the epoch's first batch is loaded. A dataset that augments in
``__getitem__`` can seed each sample's random draws from (seed, epoch, index): the
augmentation is then the same for any world size and exact across mid-epoch resumes.
``__getitem__`` runs in DataLoader worker processes, which may persist between epochs:
keep the epoch where they see it (e.g. a shared-memory tensor, as
``raytrain_app.data.synthetic_images`` does).

Ray Datasets (``train`` only)::

    def build_data(params: dict, seed: int) -> RayDataSplits
    RayDataSplits(train=ray_ds, val=ray_ds, to_batch=rows_to_tensors, info={...})
    def rows_to_tensors(rows: dict[str, np.ndarray]) -> batch

A data factory may return ``ray.data.Dataset`` objects instead. It then runs once, on the
driver, after Ray is connected (not in every worker); its datasets go to Ray Train
(``TorchTrainer(datasets=...)``) and every worker reads its shard with ``iter_batches``.
``to_batch`` turns one micro-batch of rows (the ``dict`` of NumPy arrays ``iter_batches``
gives) into what the step takes, e.g. ``(inputs, targets)`` tensors; make it a
module-level function, since workers unpickle it. What raytrain promises for them:

- The global batch per optimizer step, as planned: every rank takes
  ``per_worker_batch_size`` rows per micro-batch and accumulates gradients as the plan
  says, and every rank takes the same number of steps, ``train rows // global batch``
  per epoch. Ray's ``streaming_split(equal=True)`` gives every rank the same number of
  rows (it drops fewer than ``world_size`` of them) and raytrain adds no local shuffle
  buffer, so no rank runs short.
- NOT the same samples at every world size, and NOT an exact mid-epoch resume: Ray's split
  hands whole blocks to the rank with the fewest rows so far, differently for each world
  size, and keeps no position in an epoch. A mid-epoch resume skips this rank's batches
  already trained in the epoch on the new split: it trains the right number of steps, not
  the samples it missed. (raytrain turns Ray's locality hints off and preserves the
  order, so a deterministic pipeline splits the same way again at the same world size;
  that is how Ray behaves, not a promise.)
- Validation counts every row once, for any number of workers: ``val`` is not split.
  Every rank reads the whole validation dataset in a preserved order and keeps every
  ``world_size``-th batch (batch ``j`` goes to rank ``j % world_size``), and checks it read
  as many rows as the driver counted. So the validation pipeline must give the same rows
  in the same order each time it runs (no ``random_shuffle``), and every rank pays for
  reading all of it.
- The driver counts the rows (``Dataset.count()``: free for a materialized dataset or a
  plain Parquet read, one full run of the pipeline otherwise) and takes a few training
  rows for the checks it runs before the workers start.
- Ray Data's tasks need CPUs besides the training workers' unless the datasets are
  materialized (``Dataset.materialize()``); leave some free (``scaling.cpus_per_worker``).
- ``raytrain tune``, ``raytrain predict`` and ``--local`` refuse them: they need
  ``DataSplits`` of map-style datasets, or ``data.path`` streaming.

For an exact, world-size-invariant order and resume, give Parquet files as ``data.path``
with streaming: raytrain owns the order there.

Model factory::

    def build_model(params: dict, data_info: dict) -> ModelSpec

It returns a plain ``nn.Module`` (no ``.cuda()``, no DDP, no rank logic: raytrain places
and wraps it) and a ``step`` function computing the loss of one batch.

Gradient checkpointing hook (optional)::

    def gradient_checkpointing_enable(self) -> None

A model that has it supports ``optimizations.gradient_checkpointing``: raytrain calls it
before wrapping the model, and the model then recomputes activations in backward (e.g. with
``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)`` around each block, as
``raytrain_app.models.wind_transformer`` does). The same name as Hugging Face models use.

FLOPs per sample (optional)::

    flops_per_sample: float          # or def flops_per_sample(self) -> float

The training FLOPs of one sample, forward and backward (about 6 x parameters x tokens per
sequence for a transformer). A module that has it is taken at its word for the FLOP/s and
MFU raytrain reports; without it raytrain counts the run's first micro-batch with
``torch.utils.flop_counter`` (matmuls, convolutions and attention; ``worker.flop_count``).

Step function::

    def step(module: nn.Module, batch) -> StepOutput

``loss`` is the mean over the batch's items and ``num_samples`` their number: samples for a
classifier, the real (not padding) tokens for a sequence model whose loss skips padding
(``ignore_index=-100``), nodes for a loss over the nodes of batched graphs. ``metrics`` are
extra per-item means (e.g. ``mae``). raytrain turns both into exact global values over all
workers by weighting with ``num_samples``, and so it weights the gradient: an optimizer
step trains on ``sum(num_samples_i * loss_i) / sum(num_samples_i)`` over every micro-batch
of every worker, the mean over every item of the global batch, so the number of workers
and the accumulation never change what is trained (``worker.item_weights``).
``num_samples`` may be an int or a tensor on the device, such as
``(labels != -100).sum()``, which raytrain never reads back to the host per micro-batch.
A step whose loss is a sum over the items (``reduction="sum"``) returns it as it is with
``loss_reduction="sum"``: raytrain divides by the global count. Batches arrive on the
training device.

Batched fetching (optional)::

    def __getitems__(self, indices: list[int]) -> CollatedBatch

A dataset may gather a whole batch at once and return it as a ``CollatedBatch``;
raytrain's loaders then use it as is instead of collating one sample at a time.

Collate (optional)::

    DataSplits(train=..., val=..., collate=pad_batch)
    def pad_batch(samples: list) -> batch

A DataLoader ``collate_fn`` for samples that torch's ``default_collate`` cannot stack,
such as sequences of different lengths: pad them to the batch's longest and return the
lengths too. raytrain's training and validation loaders, the memory probe, the driver's
check of ``train.monitor`` and ``raytrain predict`` all batch with it; without it they
collate as torch does (a ``CollatedBatch`` passes through). Keep ``(inputs, targets)``
order, since ``raytrain predict`` reads the targets from ``batch[1]``, and make it a
module-level function: DataLoader worker processes pickle it.

Counted metrics (optional)::

    StepOutput(loss=..., num_samples=..., counts={"confusion": confusion_of_batch})
    ModelSpec(module=..., step=..., metrics_from_counts=f1_from_counts)
    def f1_from_counts(totals: dict[str, torch.Tensor]) -> dict[str, float]

For metrics that are not per-sample means (F1, precision and recall, AUROC from binned
scores), a step returns additive ``counts``: tensors of a fixed shape per key, such as a
confusion matrix or a histogram of scores per class. raytrain sums them over the epoch's
batches and over all workers (one all-reduce per epoch, in float64, so integer counts
stay exact) and calls ``metrics_from_counts`` once on the totals; its results appear as
``train_<name>`` and ``val_<name>`` beside the means, and ``train.monitor`` may name them.
Validation counts every sample once for any number of workers, so ``val_f1`` is the F1
of the whole validation set. The names must differ from ``loss`` and the ``metrics``
keys, and the hook must return a number for any totals (e.g. 0.0 when a denominator is 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from raytrain_app.errors import BadInputError

if TYPE_CHECKING:  # importing ray costs seconds; a worker or predict may never need it
    import numpy as np
    import ray.data


@dataclass(frozen=True)
class StepOutput:
    """Loss and metrics of one batch.

    Attributes:
        loss: scalar tensor, the mean loss over the batch's items (or their sum, see
            ``loss_reduction``); backpropagated.
        num_samples: the number of items the loss is a mean over (samples, real tokens,
            nodes): the weight of this batch's means and of its gradient. An int, or a
            one-element tensor (e.g. ``(labels != -100).sum()``) left on the device.
        metrics: extra scalar per-item means to report (detached or not).
        counts: additive tensors (e.g. a confusion matrix), each of the same shape in every
            batch; summed over batches and workers for ``ModelSpec.metrics_from_counts``.
        loss_reduction: ``"mean"`` (``loss`` is the mean over ``num_samples`` items) or
            ``"sum"`` (``loss`` is their sum, as ``reduction="sum"`` gives): raytrain then
            divides by the items of the whole global batch, and reports the mean.
    """

    loss: torch.Tensor
    num_samples: int | torch.Tensor
    metrics: Mapping[str, torch.Tensor] = field(default_factory=dict)
    counts: Mapping[str, torch.Tensor] = field(default_factory=dict)
    loss_reduction: str = "mean"

    def __post_init__(self) -> None:
        if self.loss_reduction not in ("mean", "sum"):
            raise BadInputError(
                f"StepOutput.loss_reduction={self.loss_reduction!r}; return 'mean' for a loss "
                f"averaged over num_samples items or 'sum' for a loss summed over them"
            )
        count = self.num_samples
        if isinstance(count, torch.Tensor) and count.numel() != 1:
            raise BadInputError(
                f"StepOutput.num_samples is a tensor of shape {tuple(count.shape)}; return "
                f"the batch's number of items as an int or a one-element tensor"
            )

    @property
    def mean_loss(self) -> torch.Tensor:
        """The loss as a mean over the batch's items, what metrics report (a batch without
        items has a summed loss of 0, and a mean of 0)."""
        if self.loss_reduction == "mean":
            return self.loss
        count = self.num_samples
        if isinstance(count, torch.Tensor):
            return self.loss / torch.where(count > 0, count, 1).reshape(())
        return self.loss / (count if count > 0 else 1)


StepFn = Callable[[nn.Module, Any], StepOutput]
PredictFn = Callable[[nn.Module, Any], torch.Tensor]
CountsFn = Callable[[dict[str, torch.Tensor]], Mapping[str, Any]]
CollateFn = Callable[[Any], Any]
# (module, lr, total_steps) -> (optimizer, scheduler or None)
ConfigureOptimizersFn = Callable[[nn.Module, float, int], tuple[Any, Any]]


@dataclass(frozen=True)
class ModelSpec:
    """What a model factory returns.

    Attributes:
        module: the plain model; raytrain moves it to the device and wraps it in DDP.
        step: computes the loss (and metrics) of one batch; used for training and validation.
        predict: maps a batch to predictions for ``raytrain predict``; ``None`` means
            ``module(batch[0])``.
        metrics_from_counts: turns the epoch's ``StepOutput.counts``, summed over all
            workers (float64 tensors on the CPU), into named metrics; ``None``: no counts.
        configure_optimizers: full control of the optimisation, as Lightning's hook:
            ``(module, lr, total_steps) -> (optimizer, scheduler or None)``, with ``lr`` the
            plan's (scaling applied) and the scheduler stepped once per optimizer step.
            ``None``: train.optimizer, train.schedule and their keys decide, which must then
            keep their defaults.
    """

    module: nn.Module
    step: StepFn
    predict: PredictFn | None = None
    metrics_from_counts: CountsFn | None = None
    configure_optimizers: ConfigureOptimizersFn | None = None


@dataclass(frozen=True)
class DataSplits:
    """What a data factory returns.

    Attributes:
        train: map-style dataset of training samples.
        val: map-style dataset of validation samples.
        info: JSON-serialisable facts the model factory needs; stored in checkpoints.
        collate: turns a list of samples into a batch (a DataLoader ``collate_fn``, e.g.
            padding variable-length sequences); ``None``: torch's default collate.
    """

    train: Dataset
    val: Dataset
    info: Mapping[str, Any] = field(default_factory=dict)
    collate: CollateFn | None = None

    def batch_collate(self) -> CollateFn:
        """What every loader of these splits batches with: ``collate``, or raytrain's."""
        return self.collate or collate


RowsToBatch = Callable[["dict[str, np.ndarray]"], Any]


@dataclass(frozen=True)
class RayDataSplits:
    """What a data factory may return instead of ``DataSplits``: Ray Datasets (see the
    module docstring for what raytrain promises for them).

    Attributes:
        train: the training rows; split over the workers by Ray Train.
        val: the validation rows; read whole by every worker (deterministic order needed).
        to_batch: turns a micro-batch of rows (``dict`` of NumPy arrays, one entry per
            column) into the step's batch; a module-level function (it is pickled).
        info: JSON-serialisable facts the model factory needs; stored in checkpoints.
    """

    train: ray.data.Dataset
    val: ray.data.Dataset
    to_batch: RowsToBatch
    info: Mapping[str, Any] = field(default_factory=dict)


def ray_data_refusal(config_key: str, target: str, command: str) -> str:
    """The one line with which a command that cannot use ``RayDataSplits`` refuses them."""
    return (
        f"{config_key}={target!r} returns RayDataSplits (Ray Datasets), which {command} "
        f"cannot use: it needs DataSplits of map-style datasets, or Parquet files as "
        f"data.path (streaming); only 'raytrain train' on Ray takes Ray Datasets"
    )


class CollatedBatch(Sequence):
    """A batch that a dataset's ``__getitems__`` built in one go, e.g. by one gather.

    ``fields`` is what torch's default collate makes of tuple samples: one batched tensor
    per field. raytrain's loaders (``collate``) pass it on unchanged; a DataLoader with the
    default collate sees a sequence of per-sample tuples and stacks them into equal tensors.
    """

    def __init__(self, fields: list[torch.Tensor]) -> None:
        self.fields = fields
        self._samples: list[tuple[torch.Tensor, ...]] | None = None

    def samples(self) -> list[tuple[torch.Tensor, ...]]:
        """The per-sample views, made once on first use (only the default collate asks)."""
        if self._samples is None:
            self._samples = list(zip(*(tensor.unbind(0) for tensor in self.fields), strict=True))
        return self._samples

    def __len__(self) -> int:
        return len(self.fields[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return self.samples()[index]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return iter(self.samples())


def collate(samples: Any) -> Any:
    """raytrain's DataLoader collate: a ``CollatedBatch`` as is, anything else as torch's."""
    if isinstance(samples, CollatedBatch):
        return samples.fields
    return default_collate(samples)


def check_counts_hook(spec: ModelSpec, counts: Mapping[str, torch.Tensor]) -> None:
    """Refuse ``counts`` that no ``metrics_from_counts`` would turn into metrics."""
    if counts and spec.metrics_from_counts is None:
        raise BadInputError(
            f"the step returned StepOutput.counts ({', '.join(sorted(counts))}) but the model "
            f"factory's ModelSpec has no metrics_from_counts; set "
            f"ModelSpec(metrics_from_counts=...) to report them, or leave counts out"
        )


def counted_metrics(
    spec: ModelSpec, totals: dict[str, torch.Tensor], mean_names: Sequence[str]
) -> dict[str, float]:
    """``spec.metrics_from_counts(totals)`` as floats, named apart from the loss and the
    per-sample means ``mean_names``."""
    assert spec.metrics_from_counts is not None
    values = dict(spec.metrics_from_counts(totals))
    taken = {"loss", *mean_names}
    out: dict[str, float] = {}
    for name, value in values.items():
        if name in taken:
            raise BadInputError(
                f"ModelSpec.metrics_from_counts returns {name!r}, a name StepOutput "
                f"{'loss' if name == 'loss' else 'metrics'} already reports; rename it"
            )
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise BadInputError(
                f"ModelSpec.metrics_from_counts returns {name!r} as a tensor of shape "
                f"{tuple(value.shape)}; return one number per name"
            )
        out[name] = float(value)
    return out
