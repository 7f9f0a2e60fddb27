"""fp16 with a GradScaler, run on CPU (one worker, no Ray): the loop's autocast, scaling,
accumulation and skipped-step path as a pre-Ampere GPU runs them.

The plan refuses fp16 without a CUDA GPU, so the tests override the plan's precision;
``torch.amp.GradScaler("cpu")`` does what the CUDA one does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from loop_harness import Crash, LocalSession, assert_same_run, make_task

from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.worker.step import OptimizerStep

INF_GRAD_CALL = 9  # a finite loss whose gradient overflows: the 5th optimizer step


def _fp16_task(root: Path, **train: object) -> WorkerTask:
    task = make_task(root, max_batch_per_worker=16, **train)  # 2 micro-batches per step
    task.plan = replace(task.plan, precision="fp16", grad_scaler=True)
    return task


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_a_step_the_scaler_skips_changes_neither_the_weights_nor_the_ema(tmp_path, monkeypatch):
    task = _fp16_task(
        tmp_path,
        epochs=2,
        ema={"enabled": True, "decay": 0.5, "start_step": 0},
        model_params={"inf_grad_at_calls": [INF_GRAD_CALL]},
    )
    steps: list[dict] = []
    apply = OptimizerStep.apply

    def recording_apply(stepper: OptimizerStep, step: int) -> None:
        before = (_state(stepper.module), _state(stepper.ema), stepper.scaler.get_scale())
        apply(stepper, step)
        after = (_state(stepper.module), _state(stepper.ema), stepper.scaler.get_scale())
        steps.append({"step": step, "before": before, "after": after})

    monkeypatch.setattr(OptimizerStep, "apply", recording_apply)
    loop = WorkerLoop(task, LocalSession(tmp_path / "ckpt"))
    result = loop.run()

    assert loop.stepper.scaler.is_enabled() and loop.stepper.autocast().fast_dtype == torch.float16
    skipped = [s for s in steps if s["after"][2] < s["before"][2]]  # the scale backed off
    assert 5 in [s["step"] for s in skipped]  # the forced overflow
    for s in skipped:
        for kind, before, after in zip(("weights", "ema"), s["before"], s["after"], strict=False):
            for key, value in before.items():
                assert torch.equal(after[key], value), (s["step"], kind, key)
    skipped_steps = {s["step"] for s in skipped}
    for s in steps:
        if s["step"] not in skipped_steps:  # a step taken moves the weights
            assert any(not torch.equal(s["after"][0][k], v) for k, v in s["before"][0].items())
    history = result["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]


def _scale_after(task: WorkerTask, session: LocalSession) -> tuple[tuple[dict, dict], float]:
    loop = WorkerLoop(task, session)
    result = loop.run()
    weights = {k: v.clone() for k, v in loop.module.state_dict().items()}
    return (result, weights), loop.stepper.scaler.get_scale()


def test_a_mid_epoch_resume_restores_the_scalers_scale_exactly(tmp_path):
    # The fault counts this process's micro-batches (2 per step): the reference overflows
    # at steps 4 and 25; the crashed run at step 4, its resume (from step 21) at its 8th
    # call, step 25 again. Checkpoints at steps 3, 6, ..., 15, 16 (epoch end), 18, 21.
    params = {
        "epochs": 2,
        "checkpoint_every_steps": 3,
        "model_params": {"inf_grad_at_calls": [8, 50]},
    }
    reference, reference_scale = _scale_after(
        _fp16_task(tmp_path / "a", **params), LocalSession(tmp_path / "a" / "c")
    )
    task = _fp16_task(tmp_path / "b", **params)
    storage = tmp_path / "b" / "c"
    with pytest.raises(Crash):
        WorkerLoop(task, LocalSession(storage, crash_after_checkpoints=8)).run()
    resumed, resumed_scale = _scale_after(task, LocalSession(storage))
    assert reference_scale <= 2.0**16 / 4  # backed off at least twice
    assert resumed_scale == reference_scale
    assert_same_run(resumed, reference)  # bit for bit, skipped steps included
