"""The worker sets TF32 both ways from the plan: cuDNN's TF32 is on by default in torch, so
an explicit fp32 run (plan.tf32 False) must turn it off, and a reused Tune process must not
carry one trial's TF32 into the next. The flags are plain switches, settable on CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from loop_harness import LocalSession, make_task

from raytrain_app.worker.loop import WorkerLoop


@pytest.mark.parametrize("tf32", [False, True])
def test_the_worker_sets_tf32_as_the_plan_says_whatever_was_set_before(tmp_path, tf32):
    task = make_task(tmp_path, epochs=1)
    loop = WorkerLoop(task, LocalSession(tmp_path / "ckpt"))
    loop.plan = replace(loop.plan, tf32=tf32)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    try:
        loop.setup()
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
        assert torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
