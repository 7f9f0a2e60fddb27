"""Streaming data's lanes serve the cluster sizes people have, and a run keeps its lanes.

- ``raytrain plan`` accepts 12, 24 and 48 streaming workers (3 x 4, 3 x 8, 6 x 8 GPUs) with
  global batches they divide; ``num_workers: auto`` never picks a size streaming refuses.
- A refusal names a ``scaling.num_workers`` that works: fed back, the plan accepts it.
- A resume keeps the lane count its checkpoints record (an older checkpoint's: the rule
  it was written under), so a resume at another world size continues the same order, or
  is refused in one line when that size cannot share it.
"""

from __future__ import annotations

import json
import re

import pytest
import ray
import torch
from environments import make_env

from raytrain_app import cli
from raytrain_app.checkpoint.store import save_checkpoint
from raytrain_app.config import config_from_dict
from raytrain_app.driver.data_plan import data_plan
from raytrain_app.driver.stream_lanes import stream_lanes
from raytrain_app.errors import BadInputError
from raytrain_app.planning.rules import make_plan
from raytrain_app.storage import StorageLocation
from raytrain_app.worker.loop import WorkerTask
from raytrain_app.worker.reporting import checkpoint_meta
from raytrain_app.workloads import FactoryRef

# The built-in wind data, streamed (generated when the run starts: nothing to prepare).
STREAMING = {"data": {"streaming": True}, "fault_tolerance": {"max_failures": 1}}


def _config(workers: object, batch: int) -> dict:
    return {
        **STREAMING,
        "train": {"global_batch_size": batch},
        "scaling": {"num_workers": workers},
    }


@pytest.fixture
def no_ray(monkeypatch, tmp_path):
    """An empty cwd, and ``ray.init`` failing the test if the CLI reaches it."""

    def refuse(*args, **kwargs):
        raise AssertionError("raytrain plan started Ray")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(("workers", "batch"), [(12, 1536), (24, 3072), (48, 6144), (48, 1536)])
def test_raytrain_plan_accepts_12_24_and_48_streaming_workers(no_ray, capsys, workers, batch):
    sets = ["data.streaming=true", f"scaling.num_workers={workers}"]
    sets.append(f"train.global_batch_size={batch}")
    code = cli.main(["plan", "--json", *(arg for s in sets for arg in ("--set", s))])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    shown = json.loads(captured.out)
    assert shown["world_size"] == workers
    assert shown["data"]["lanes"] % workers == 0 and batch % shown["data"]["lanes"] == 0


@pytest.mark.parametrize("batch", [64, 96, 1536, 3072, 6144, 1000, 4096, 2**20 * 3])
@pytest.mark.parametrize("devices", [2, 12, 24, 48, 100, 300, 600])
def test_auto_never_picks_a_size_streaming_refuses(batch, devices):
    cfg = config_from_dict(_config("auto", batch))
    plan = make_plan(cfg, make_env(cpus=devices, source="ray cluster"))
    described = data_plan(cfg, plan)  # what raytrain plan shows; it refuses what fails
    assert described["lanes"] % plan.world_size == 0
    # The most workers that any lane count serves: none is left idle for nothing.
    served = [w for w in range(1, min(devices, 256) + 1) if batch % w == 0]
    assert plan.world_size == max(served)


@pytest.mark.parametrize(
    ("workers", "batch"),
    [(512, 1024), (384, 3 * 2**12), ([4, 8], 1680), ([7, 9], 504)],
)
def test_a_refusal_names_num_workers_that_work(workers, batch):
    cfg = config_from_dict(_config(workers, batch))
    env = make_env(cpus=1024, source="ray cluster")
    plan = make_plan(cfg, env)
    with pytest.raises(BadInputError, match="streaming data needs a lane count") as refused:
        data_plan(cfg, plan)
    message = str(refused.value)
    assert "\n" not in message and "factors of two" not in message
    suggested = re.search(r"set scaling\.num_workers=(.+)$", message)[1]
    fixed = config_from_dict(_config(json.loads(suggested), batch))
    fixed_plan = make_plan(fixed, env)
    assert data_plan(fixed, fixed_plan)["lanes"] % fixed_plan.world_size == 0


def test_lanes_of_batches_up_to_256_stay_the_batch_as_before():
    """Runs of the usual batches keep the order they had: C is the batch itself."""
    for batch in (2, 32, 64, 96, 100, 256):
        for workers in (w for w in (1, 2, 4) if batch % w == 0):
            cfg = config_from_dict(_config(workers, batch))
            assert data_plan(cfg, make_plan(cfg, make_env(cpus=4)))["lanes"] == batch


def _checkpoint(folder, lanes: int | None) -> StorageLocation:
    """A run's checkpoints folder holding one checkpoint whose meta.json the workers wrote
    with ``lanes`` in their task."""
    task = WorkerTask(
        config={},
        plan=None,
        data=FactoryRef("raytrain_app.data.synthetic_wind:build"),
        model=FactoryRef("raytrain_app.models.wind_transformer:build"),
        run_dir=str(folder),
        stream_lanes=lanes,
    )
    meta = {**checkpoint_meta(task, {}), "epoch": 1, "step": 10}
    save_checkpoint(
        folder / "run" / "checkpoint_epoch0001_step000000010",
        model={"w": torch.zeros(1)},
        train_state={},
        meta=meta,
    )
    return StorageLocation.local(folder)


@pytest.mark.parametrize(
    ("recorded", "resumed_at", "lanes"),
    [
        (256, 16, 256),  # started on 128 workers; 16 alone would choose 192
        (192, 24, 192),  # started on 12 workers, resumed on 3 nodes x 8
        (None, 16, 256),  # written before lanes were recorded: the rule of then
    ],
)
def test_a_resume_keeps_the_lanes_its_checkpoints_record(tmp_path, recorded, resumed_at, lanes):
    cfg = config_from_dict(_config(resumed_at, 1536))
    plan = make_plan(cfg, make_env(cpus=256, source="ray cluster"))
    assert stream_lanes(cfg, plan, None) == 192  # a new run's own choice
    assert stream_lanes(cfg, plan, _checkpoint(tmp_path, recorded)) == lanes


@pytest.mark.parametrize("recorded", [256, None])
def test_a_resume_its_size_cannot_share_the_recorded_lanes_is_one_line(tmp_path, recorded):
    cfg = config_from_dict(_config(12, 1536))
    plan = make_plan(cfg, make_env(cpus=256, source="ray cluster"))
    with pytest.raises(BadInputError, match=r"over 256 lanes.* one of 1, 2, 4, 8, 16") as caught:
        stream_lanes(cfg, plan, _checkpoint(tmp_path, recorded))
    assert "\n" not in str(caught.value) and "experiment.name" in str(caught.value)
