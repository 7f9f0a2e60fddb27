"""A Hugging Face ``transformers`` causal language model as a raytrain workload.

Train it, then export the best checkpoint to the Hugging Face layout::

    pip install -e ".[hf]"
    PYTHONPATH=examples raytrain train --config examples/hf_causal_lm.yaml
    PYTHONPATH=examples raytrain export --checkpoint runs/hf_causal_lm \\
        --config examples/hf_causal_lm.yaml --output tiny-llama
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('tiny-llama')"

The model is a small Llama built from a ``LlamaConfig`` (nothing is downloaded). The
text is the Python Language Reference's topics that ship with every Python for ``help()``
(``pydoc_data.topics``); each paragraph is one sequence, so the sequences differ in
length. The tokenizer is byte-level (no vocabulary file): a token is a byte of the UTF-8
text, byte 0 pads.

``pad_batch`` (the ``collate`` of ``DataSplits``) pads each micro-batch to its longest
sequence and returns a ``BatchEncoding`` (``input_ids``, ``attention_mask``, ``labels``),
as a tokenizer's ``pad`` does; ``labels`` are -100 on padding, which the model's loss
leaves out. The step's loss is the mean over the real tokens the model predicts, so
``num_samples`` is their count: every position but the first of each sequence (the model
shifts the labels by one inside).
"""

from __future__ import annotations

from pydoc_data.topics import topics

import torch
from torch import nn
from transformers import BatchEncoding, LlamaConfig, LlamaForCausalLM

from raytrain_app import BadInputError, DataSplits, ModelSpec, StepOutput

PAD = 0  # byte 0 never occurs in the text: it only pads
IGNORE = -100  # the label the loss leaves out (torch's and Hugging Face's ignore_index)
VOCAB_SIZE = 256  # one token per byte value


def encode(text: str) -> torch.Tensor:
    """The byte-level tokens of ``text``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """``tokens`` back to text, padding dropped."""
    return bytes(int(t) for t in tokens if t != PAD).decode("utf-8", errors="replace")


def reference_paragraphs() -> list[str]:
    """Every distinct paragraph of the Python Language Reference's topics that ship with
    Python for ``help()`` (``pydoc_data.topics``: data, the same in every process),
    whitespace collapsed, in a fixed order."""
    paragraphs = (
        " ".join(paragraph.split())
        for name in sorted(topics)
        for paragraph in topics[name].split("\n\n")
    )
    return list(dict.fromkeys(paragraphs))


class TokenSequences(torch.utils.data.Dataset):
    """Byte sequences of different lengths; a sample is one sequence's tokens."""

    def __init__(self, sequences: list[torch.Tensor]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sequences[index]


def pad_batch(samples: list[torch.Tensor]) -> BatchEncoding:
    """The micro-batch padded to its longest sequence: ``input_ids`` and ``labels`` [B, L]
    (``labels`` -100 on padding) and ``attention_mask`` (1 on real tokens)."""
    input_ids = nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=PAD)
    lengths = torch.tensor([len(sample) for sample in samples])
    real = torch.arange(input_ids.shape[1]) < lengths[:, None]
    labels = input_ids.masked_fill(~real, IGNORE)
    return BatchEncoding({"input_ids": input_ids, "attention_mask": real.long(), "labels": labels})


def build_data(params: dict, seed: int) -> DataSplits:
    """Paragraphs of ``min_length`` bytes or more, cut at ``max_length``, shuffled with
    ``seed``; ``num_samples`` of them (all by default), ``train_fraction`` for training."""
    low, high = int(params.get("min_length", 16)), int(params.get("max_length", 96))
    texts = [text for text in reference_paragraphs() if len(text.encode("utf-8")) >= low]
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed))
    sequences = [encode(texts[i])[:high] for i in order.tolist()]
    sequences = sequences[: int(params.get("num_samples", len(sequences)))]
    split = int(float(params.get("train_fraction", 0.9)) * len(sequences))
    return DataSplits(
        train=TokenSequences(sequences[:split]),
        val=TokenSequences(sequences[split:]),
        info={"vocab_size": VOCAB_SIZE, "max_length": high},
        collate=pad_batch,
    )


def causal_lm_step(module: nn.Module, batch: BatchEncoding) -> StepOutput:
    """The model's own loss: the mean over every label but -100 after the shift by one;
    ``num_samples`` counts those labels, so metrics and gradients weigh tokens, not
    sequences, and any number of workers trains the same model."""
    out = module(**batch)
    predicted = batch["labels"][:, 1:]
    real = predicted != IGNORE
    correct = (out.logits[:, :-1].argmax(-1) == predicted) & real
    tokens = real.sum()
    return StepOutput(
        loss=out.loss,
        num_samples=tokens,  # a tensor: raytrain never reads it back per micro-batch
        metrics={"accuracy": correct.sum() / tokens},  # next-byte accuracy, per real token
    )


def build_model(params: dict, data_info: dict) -> ModelSpec:
    """A Llama of ``hidden`` width and ``layers`` layers from its config (no download)."""
    hidden, heads = int(params.get("hidden", 64)), int(params.get("heads", 4))
    if hidden % heads:  # Llama would build the model, then fail in its first forward
        raise BadInputError(
            f"model.params.hidden {hidden} is not a multiple of model.params.heads {heads}; "
            f"choose heads that divide it"
        )
    config = LlamaConfig(
        vocab_size=data_info["vocab_size"],
        max_position_embeddings=data_info["max_length"],
        hidden_size=hidden,
        intermediate_size=int(params.get("intermediate", 4 * hidden)),
        num_hidden_layers=int(params.get("layers", 2)),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=None,  # byte-level text: no special tokens
        eos_token_id=None,
    )
    return ModelSpec(module=LlamaForCausalLM(config), step=causal_lm_step)
