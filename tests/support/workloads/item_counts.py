"""Workloads whose loss is a mean over a number of items that varies from batch to batch,
for the tests of item-weighted gradients (``worker/item_weights.py``).

``build_tokens`` / ``build_tagger``: token sequences of 2 to 24 tokens, padded to each
micro-batch's longest; a GRU predicts every next token, the loss is the mean over the real
tokens (padding labelled -100) and ``num_samples`` is their count, a tensor, as a language
model counts them. ``build_graphs`` / ``build_node_regressor``: graphs of 1 to 12 nodes
batched by concatenating their nodes; a per-node MLP with each graph's mean pooled back, the
loss a mean over nodes and ``num_samples`` the node count, an int. ``model.params``
``reduction: sum`` makes either step return the summed loss (``loss_reduction="sum"``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from raytrain_app import DataSplits, ModelSpec, StepOutput

IGNORE = -100  # the label of padding, as torch's cross_entropy and Hugging Face take it
VOCAB = 12


class Samples(Dataset):
    def __init__(self, samples: list) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


def pad_tokens(samples: list[tuple[torch.Tensor, torch.Tensor]]):
    """``(tokens [B, longest], labels [B, longest])``, labels -100 on the padding."""
    tokens, labels = zip(*samples, strict=True)
    return (
        pad_sequence(list(tokens), batch_first=True, padding_value=0),
        pad_sequence(list(labels), batch_first=True, padding_value=IGNORE),
    )


def build_tokens(params: dict, seed: int) -> DataSplits:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(int(params.get("num_samples", 160))):
        length = int(torch.randint(2, 25, (), generator=generator))
        tokens = torch.randint(1, VOCAB, (length,), generator=generator)
        labels = torch.cat([tokens[1:], torch.tensor([IGNORE])])  # the next token
        samples.append((tokens, labels))
    return DataSplits(train=Samples(samples[:128]), val=Samples(samples[128:]), collate=pad_tokens)


class Tagger(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden, padding_idx=0)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)  # causal: padding comes after
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(tokens))[0])


def build_tagger(params: dict, data_info: dict) -> ModelSpec:
    reduction = params.get("reduction", "mean")

    def step(module: nn.Module, batch) -> StepOutput:
        tokens, labels = batch
        logits = module(tokens)
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction=reduction
        )
        real = (labels != IGNORE).sum()  # on the device, as a language model counts tokens
        return StepOutput(loss=loss, num_samples=real, loss_reduction=reduction)

    return ModelSpec(module=Tagger(int(params.get("hidden", 16))), step=step)


def batch_graphs(samples: list[tuple[torch.Tensor, torch.Tensor]]):
    """``(features [nodes, F], graph of each node [nodes], targets [nodes])``."""
    features, targets = zip(*samples, strict=True)
    graph = torch.cat([torch.full((len(f),), i) for i, f in enumerate(features)])
    return torch.cat(features), graph, torch.cat(targets)


def build_graphs(params: dict, seed: int) -> DataSplits:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(int(params.get("num_samples", 160))):
        nodes = int(torch.randint(1, 13, (), generator=generator))
        features = torch.randn(nodes, 4, generator=generator)
        targets = features.sum(1).tanh() + features.mean(0).sum()  # depends on the graph
        samples.append((features, targets))
    return DataSplits(
        train=Samples(samples[:128]), val=Samples(samples[128:]), collate=batch_graphs
    )


class NodeRegressor(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.node = nn.Sequential(nn.Linear(4, hidden), nn.Tanh())
        self.head = nn.Linear(2 * hidden, 1)

    def forward(self, features: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
        h = self.node(features)
        graphs = int(graph.max()) + 1
        sums = h.new_zeros(graphs, h.shape[1]).index_add_(0, graph, h)
        sizes = torch.bincount(graph, minlength=graphs).unsqueeze(1).to(h.dtype)
        pooled = (sums / sizes)[graph]  # each node sees its graph's mean
        return self.head(torch.cat([h, pooled], dim=1)).squeeze(1)


def build_node_regressor(params: dict, data_info: dict) -> ModelSpec:
    reduction = params.get("reduction", "mean")

    def step(module: nn.Module, batch) -> StepOutput:
        features, graph, targets = batch
        loss = nn.functional.mse_loss(module(features, graph), targets, reduction=reduction)
        return StepOutput(loss=loss, num_samples=len(targets), loss_reduction=reduction)

    return ModelSpec(module=NodeRegressor(int(params.get("hidden", 16))), step=step)
