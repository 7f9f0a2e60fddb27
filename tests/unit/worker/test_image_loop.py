"""The image workload in the worker loop, one worker in this process (no Ray): augmentation
in a persistent loader process stays exact across a mid-epoch resume, and the checkpoint of
a SyncBatchNorm-converted model loads and predicts as a plain one."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from loop_harness import Crash, LocalSession, assert_same_run, worker_task
from torch import nn

import raytrain_app as rt
from raytrain_app.checkpoint import store as ckpt
from raytrain_app.config import config_from_dict
from raytrain_app.predict import predict
from raytrain_app.worker.loop import WorkerLoop, WorkerTask

SMALL = {"num_train": 128, "num_val": 30, "image_size": 16, "pad": 2}


def _image_task(tmp_path: Path, **train: object) -> WorkerTask:
    raw = {
        "experiment": {"name": "images", "output_dir": str(tmp_path / "runs"), "seed": 1},
        "model": {"name": "resnet_small", "params": {"widths": [8]}},
        "data": {"name": "synthetic_images", "params": SMALL},
        "train": {"epochs": 2, "global_batch_size": 16, "lr": 0.01, **train},
        "scaling": {"num_workers": 1},
        # Converted even for one worker (a no-op there): the checkpoint must not care.
        "distributed": {"sync_batchnorm": True},
        # Augmentation runs in a loader process that persists across epochs and resumes.
        "dataloader": {"num_workers": 1},
    }
    return worker_task(config_from_dict(raw), tmp_path / "runs" / "images")


def _run(task: WorkerTask, session: LocalSession) -> tuple[dict, dict[str, torch.Tensor]]:
    """``run_loop`` that also checks the dataset's epoch hook and that the loop stopped its
    persistent loader processes: left to the cyclic garbage collector, each would wait 5 s
    to be killed, in a reused Tune actor too.
    """
    loop = WorkerLoop(task, session)
    result = loop.run()
    # The loop called the dataset's epoch hook (protocol.py) for the last epoch.
    assert int(loop.loaders.train.dataset._epoch) == task.config["train"]["epochs"] - 1
    iterators = [loader._iterator for loader in loop.loaders.raw if loader._iterator]
    assert iterators  # persistent loader processes ran
    assert not any(process.is_alive() for it in iterators for process in it._workers)
    return result, {k: v.clone() for k, v in loop.module.state_dict().items()}


def test_an_image_run_resumes_mid_epoch_exactly_and_its_checkpoint_predicts(tmp_path):
    params = {"checkpoint_every_steps": 3}
    reference = _run(_image_task(tmp_path / "a", **params), LocalSession(tmp_path / "a" / "c"))
    assert set(reference[0]["history"][-1]) >= {"train_accuracy", "val_accuracy"}

    task, storage = _image_task(tmp_path / "b", **params), tmp_path / "b" / "c"
    # 8 steps per epoch; checkpoints at steps 3, 6, 8 (epoch end), 9, 12: the 5th is
    # 4 steps into epoch 2, where the crops and flips must continue exactly.
    with pytest.raises(Crash):
        _run(task, LocalSession(storage, crash_after_checkpoints=5))
    resumed = _run(task, LocalSession(storage))
    assert_same_run(resumed, reference)

    newest = LocalSession(storage).checkpoints()[0]
    model = rt.load_model(newest)
    norms = [type(m) for m in model.modules() if "BatchNorm" in type(m).__name__]
    assert norms and set(norms) == {nn.BatchNorm2d}  # plain layers, not the synced ones
    table = pq.read_table(predict(newest, output_path=tmp_path / "pred.parquet")).to_pydict()
    assert table.keys() == {"pred_0", "true_0"} and len(table["pred_0"]) == SMALL["num_val"]
    correct = [p == t for p, t in zip(table["pred_0"], table["true_0"], strict=True)]
    # The reported val_accuracy is that of the checkpoint's weights on every val image.
    assert sum(correct) / len(correct) == pytest.approx(
        ckpt.read_meta(newest)["metrics"]["val_accuracy"]
    )
