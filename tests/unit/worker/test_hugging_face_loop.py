"""The Hugging Face example (``examples/hf_causal_lm.py``: a small Llama built from its
config, byte-level stdlib docstrings of varying length, ``BatchEncoding`` batches whose
``labels`` are -100 on padding) in the worker loop on two gloo ranks, no Ray: it learns,
and a run cut mid-epoch resumes to the very history and weights of an uncut one."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import hf_causal_lm
import pytest
import torch
from gloo_ranks import run_on_two_ranks
from loop_harness import Crash, LocalSession, run_loop, without_timings, worker_task
from torch.nn import functional as F
from transformers import BatchEncoding, LlamaForCausalLM

from raytrain_app.config import config_from_dict
from raytrain_app.worker.loop import WorkerLoop, WorkerTask

# 180 training sequences (11 steps of 16 per epoch), 20 validation sequences: 10 per rank.
DATA = {"num_samples": 200, "min_length": 16, "max_length": 48}
MODEL = {"hidden": 32, "layers": 2, "heads": 2}
# Checkpoints at steps 4, 8, 11 (epoch 1's end), 12, 16: the 5th is 5 steps into epoch 2.
CHECKPOINT_EVERY, CRASH_AFTER = 4, 5
TOLERANCE = 1e-5  # 1 and 2 workers' weights after 22 Adam steps: float rounding apart


def hf_task(root: Path, world_size: int, **train: object) -> WorkerTask:
    raw = {
        "experiment": {"name": "hf", "output_dir": str(root / "runs"), "seed": 4},
        "model": {"target": "hf_causal_lm:build_model", "params": MODEL},
        "data": {"target": "hf_causal_lm:build_data", "params": DATA},
        "train": {"epochs": 2, "global_batch_size": 16, "lr": 3.0e-3, **train},
        "scaling": {"num_workers": world_size},
        "distributed": {"backend": "gloo"},
        "dataloader": {"num_workers": 0},
    }
    return worker_task(config_from_dict(raw), root / "runs" / "hf")


class TwoRankSession(LocalSession):
    """One of two gloo ranks; both die together at the ``crash_after``-th checkpoint
    (every rank is told each checkpoint's name)."""

    def __init__(self, storage: Path, crash_after: int | None = None) -> None:
        super().__init__(storage)
        self.crash_after_named, self.named = crash_after, 0

    def report(self, metrics, saved, name) -> None:
        super().report(metrics, saved, name)
        self.named += name is not None
        if self.crash_after_named is not None and self.named >= self.crash_after_named:
            raise Crash


def _rank(rank: int, reference: WorkerTask, cut: WorkerTask) -> dict:
    """An uncut run, then a run that dies mid-epoch and is resumed from its checkpoint."""
    torch.set_num_threads(1)
    loop = WorkerLoop(reference, TwoRankSession(Path(reference.run_dir) / "ckpt"))
    history = loop.run()["history"]
    storage = Path(cut.run_dir) / "ckpt"
    try:
        WorkerLoop(cut, TwoRankSession(storage, CRASH_AFTER)).run()
        crashed = False
    except Crash:
        crashed = True
    resumed = WorkerLoop(cut, TwoRankSession(storage))
    return {
        "history": history,
        "weights": loop.module.state_dict(),
        "crashed": crashed,
        "resumed_history": resumed.run()["history"],
        "resumed_weights": resumed.module.state_dict(),
        "module": type(loop.module).__name__,
    }


def test_the_hf_example_trains_on_two_workers_and_resumes_mid_epoch_exactly(tmp_path):
    every = {"checkpoint_every_steps": CHECKPOINT_EVERY}
    work = functools.partial(
        _rank,
        reference=hf_task(tmp_path / "ref", 2, **every),
        cut=hf_task(tmp_path / "cut", 2, **every),
    )
    ranks = run_on_two_ranks(work, tmp_path)
    one, one_weights = run_loop(hf_task(tmp_path / "one", 1, **every), LocalSession(tmp_path / "c"))

    for rank in ranks:
        assert rank["module"] == "LlamaForCausalLM"
        assert rank["crashed"]
        assert without_timings(rank["resumed_history"]) == without_timings(rank["history"])
        for key, tensor in rank["weights"].items():
            assert torch.equal(rank["resumed_weights"][key], tensor), key
            assert torch.equal(ranks[0]["weights"][key], tensor), key  # DDP kept them equal
    # Sequences of different lengths, a loss over their real tokens: 1 worker trains what
    # 2 do, as each step's gradient is the mean over every token of the global batch.
    for key, tensor in one_weights.items():
        torch.testing.assert_close(ranks[0]["weights"][key], tensor, rtol=0, atol=TOLERANCE)
    history = ranks[0]["history"]
    for row_one, row_two in zip(one["history"], history, strict=True):
        assert row_one["train_loss"] == pytest.approx(row_two["train_loss"], rel=1e-6)
    assert [row["step"] for row in history] == [11, 22]
    # It learned: from a uniform guess over 256 bytes (ln 256 = 5.5) to well below it.
    assert history[-1]["val_loss"] < 0.8 * math.log(256)
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert history[-1]["val_accuracy"] > 0.1  # next-byte accuracy over the real tokens


def test_the_collate_pads_to_the_longest_and_the_loss_is_over_the_real_tokens_only():
    torch.manual_seed(0)
    sequences = [hf_causal_lm.encode(text) for text in ("Return the sum.", "Pad me", "x = 1")]
    batch = hf_causal_lm.pad_batch(sequences)
    assert isinstance(batch, BatchEncoding)
    longest = max(len(s) for s in sequences)
    assert batch["input_ids"].shape == batch["labels"].shape == (3, longest)
    for row, sequence in enumerate(sequences):
        real = len(sequence)
        assert batch["labels"][row, :real].tolist() == sequence.tolist()
        assert (batch["labels"][row, real:] == -100).all()
        assert batch["attention_mask"][row].tolist() == [1] * real + [0] * (longest - real)

    spec = hf_causal_lm.build_model(MODEL, {"vocab_size": 256, "max_length": 48})
    assert isinstance(spec.module, LlamaForCausalLM)
    out = spec.step(spec.module, batch)
    # Each sequence predicts every token but its first: that many real labels in all.
    assert out.num_samples == sum(len(s) - 1 for s in sequences)
    token_losses = []
    for sequence in sequences:  # each sequence alone, unpadded: no padding to leave out
        logits = spec.module(input_ids=sequence[None]).logits[0, :-1]
        token_losses.append(F.cross_entropy(logits, sequence[1:], reduction="none"))
    torch.testing.assert_close(out.loss, torch.cat(token_losses).mean())
