"""A user workload with variable-length sequences and an exact F1: padding by a collate,
F1 from confusion counts summed over all workers.

Train it with::

    PYTHONPATH=examples raytrain train --config examples/sequences.yaml

Each sample is a sequence of 4 to 24 tokens, labelled 1 when the keyword token appears at
least twice. ``pad_batch`` (the ``collate`` of ``DataSplits``) pads each batch to its
longest sequence; a GRU reads the packed sequences. F1 is not a per-sample mean, so the
step returns the batch's confusion matrix as ``counts``: raytrain sums the matrices over
the epoch and over every worker, and ``f1_from_counts`` turns the totals into the exact
F1 of the whole validation set (``val_f1`` in metrics.csv) for any number of workers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import Dataset

from raytrain_app import DataSplits, ModelSpec, StepOutput

PAD = 0  # token 0 only pads; real tokens are 1 .. vocab-1
KEYWORD = 1


class Sequences(Dataset):
    """Token sequences of different lengths and their 0/1 labels."""

    def __init__(self, tokens: list[torch.Tensor], labels: torch.Tensor) -> None:
        self.tokens, self.labels = tokens, labels

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index], self.labels[index]


def pad_batch(samples: list[tuple[torch.Tensor, torch.Tensor]]):
    """``((tokens [B, longest], lengths [B]), labels [B])``: inputs first, targets second."""
    tokens, labels = zip(*samples, strict=True)
    lengths = torch.tensor([len(t) for t in tokens])
    return (pad_sequence(list(tokens), batch_first=True, padding_value=PAD), lengths), torch.stack(
        labels
    )


def build_data(params: dict, seed: int) -> DataSplits:
    """Random sequences, deterministic for ``seed`` (every worker builds the same)."""
    generator = torch.Generator().manual_seed(seed)
    n, vocab = int(params.get("num_samples", 1024)), int(params.get("vocab", 10))
    low, high = int(params.get("min_length", 4)), int(params.get("max_length", 24))
    lengths = torch.randint(low, high + 1, (n,), generator=generator).tolist()
    tokens = [torch.randint(1, vocab, (length,), generator=generator) for length in lengths]
    labels = torch.tensor([float((t == KEYWORD).sum() >= 2) for t in tokens])
    split = int(float(params.get("train_fraction", 0.8)) * n)
    return DataSplits(
        train=Sequences(tokens[:split], labels[:split]),
        val=Sequences(tokens[split:], labels[split:]),
        info={"vocab": vocab},
        collate=pad_batch,
    )


class SequenceClassifier(nn.Module):
    """Embedding, a GRU over the packed sequences, one logit from the last hidden state."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, padding_idx=PAD)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(
            self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        _, last = self.gru(packed)
        return self.head(last[-1]).squeeze(-1)


def _step(module: nn.Module, batch) -> StepOutput:
    (tokens, lengths), labels = batch
    logits = module(tokens, lengths)
    predicted, actual = (logits > 0).long(), labels.long()
    return StepOutput(
        loss=nn.functional.binary_cross_entropy_with_logits(logits, labels),
        num_samples=len(labels),
        metrics={"accuracy": (predicted == actual).float().mean()},
        # confusion[actual, predicted]: additive, so sums over batches and workers are exact
        counts={"confusion": torch.bincount(2 * actual + predicted, minlength=4).view(2, 2)},
    )


def f1_from_counts(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    """F1, precision and recall of the positive class from the summed confusion matrix."""
    confusion = totals["confusion"]
    tp, fp, fn = confusion[1, 1].item(), confusion[0, 1].item(), confusion[1, 0].item()
    return {
        "f1": 2 * tp / (2 * tp + fp + fn) if tp else 0.0,
        "precision": tp / (tp + fp) if tp else 0.0,
        "recall": tp / (tp + fn) if tp else 0.0,
    }


def _predict(module: nn.Module, batch) -> torch.Tensor:
    """The predicted class of each sequence (``raytrain predict``)."""
    tokens, lengths = batch[0]
    return (module(tokens, lengths) > 0).float()


def build_model(params: dict, data_info: dict) -> ModelSpec:
    module = SequenceClassifier(data_info["vocab"], int(params.get("hidden", 16)))
    return ModelSpec(
        module=module, step=_step, predict=_predict, metrics_from_counts=f1_from_counts
    )
