"""``distributed.strategy: fsdp`` on a real Ray with 2 gloo workers (FSDP2 on CPU).

Three short runs of one config, shared by the tests: DDP, FSDP, and FSDP with rank 1
SIGKILLed mid-epoch (after Ray has recorded a mid-epoch checkpoint, so the restart point is
known). Every rank writes its shards into the checkpoint Ray records; the killed run resumes
from them bit for bit, and the run's model loads as a plain module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import raytrain_app as rt
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.checkpoint.sharded import SHARDED_METADATA_FILE
from raytrain_app.tracking.metrics_log import TIMING_COLUMNS
from raytrain_app.workloads import FactoryRef, build_data

pytestmark = pytest.mark.distributed

# 322 samples: 257 train / 65 validation. Validation batches of 16: rank 0 runs 3 (33
# samples), rank 1 runs 2 and a third, uncounted, forward to match (FSDP's forward is
# collective). Global batch 32: 8 steps an epoch; checkpoints at steps 4, 8, 12, 16.
KILL_AT_CALL = 14  # rank 1's 14th micro-batch: step 14, after the mid-epoch checkpoint 12


def _config(output_dir: Path, name: str, strategy: str, **model_params) -> dict:
    return {
        "experiment": {"name": name, "output_dir": str(output_dir), "seed": 5},
        "model": {
            "target": "paused_faults:build_model",
            "params": {"dropout": 0.1, **model_params},
        },
        "data": {"target": "paused_faults:build_data", "params": {"num_samples": 322}},
        "train": {
            "epochs": 2,
            "global_batch_size": 32,
            "lr": 0.01,
            "optimizer": "adamw",
            "checkpoint_every_steps": 4,
            "grad_clip": 0.5,
        },
        "scaling": {"num_workers": 2},
        "distributed": {"strategy": strategy},
        "dataloader": {"num_workers": 0},
        "fault_tolerance": {"max_failures": 1},
    }


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    marker = out / "killed"
    killed = _config(
        out,
        "killed",
        "fsdp",
        kill_rank=1,
        kill_at_call=KILL_AT_CALL,
        marker=str(marker),
        checkpoints_dir=str(out / "killed" / "checkpoints" / "killed"),
        await_step=12,
    )
    runs = {
        "ddp": rt.train(_config(out, "ddp", "ddp"), progress=False),
        "fsdp": rt.train(_config(out, "fsdp", "fsdp"), progress=False),
        "killed": rt.train(killed, progress=False),
    }
    assert marker.exists(), "the worker was never killed"
    return runs


def test_fsdp_reaches_the_val_loss_of_ddp(runs):
    ddp, fsdp = runs["ddp"].metrics, runs["fsdp"].metrics
    assert runs["fsdp"].summary["strategy"] == "fsdp"
    assert len(fsdp) == len(ddp) == 2
    for fsdp_row, ddp_row in zip(fsdp, ddp, strict=True):
        assert fsdp_row["val_loss"] == pytest.approx(ddp_row["val_loss"], rel=1e-3)
    assert fsdp[-1]["val_loss"] < fsdp[0]["val_loss"]


def test_every_rank_s_shard_is_in_the_recorded_checkpoint(runs):
    checkpoint = Path(runs["fsdp"].checkpoint)
    names = {p.name for p in checkpoint.iterdir()}
    assert {SHARDED_METADATA_FILE, "__0_0.distcp", "__1_0.distcp"} <= names
    ckpt.verify_checkpoint(checkpoint)
    assert not list(checkpoint.parent.glob("*.partial"))


def test_a_worker_killed_mid_epoch_resumes_from_the_shards_bit_for_bit(runs):
    killed, straight = runs["killed"], runs["fsdp"]
    assert killed.summary["status"] == "completed"
    drop = TIMING_COLUMNS
    assert [{k: v for k, v in r.items() if k not in drop} for r in killed.metrics] == [
        {k: v for k, v in r.items() if k not in drop} for r in straight.metrics
    ]
    a, b = (
        rt.load_model(killed.checkpoint, trust_code=True),
        rt.load_model(straight.checkpoint, trust_code=True),
    )
    for key, tensor in b.state_dict().items():
        assert torch.equal(a.state_dict()[key], tensor), key


def test_load_model_returns_a_plain_module_that_scores_the_reported_val_loss(runs):
    result = runs["fsdp"]
    model = rt.load_model(result.run_dir, trust_code=True)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert not model.training
    meta = ckpt.read_meta(Path(result.checkpoint))
    splits = build_data(FactoryRef(**meta["data_factory"]), 5)
    with torch.no_grad():
        x, y = splits.val.tensors
        loss = nn.functional.mse_loss(model(x), y).item()
    assert result.metrics[-1]["val_loss"] == pytest.approx(loss, rel=1e-6)
