"""``raytrain train --local`` trains on the plan's device: on CPU when ``scaling.use_gpu``
is false on a CUDA machine (Ray's local mode would pick CUDA), and ``--nproc`` is refused
in one line when it starts more processes than the machine has GPUs. The CUDA machine is
faked: torch reports CUDA devices that this CPU build does not have, so any CUDA call
fails the run."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from environments import A100
from fault_runs import fault_config

from raytrain_app.config import config_from_dict
from raytrain_app.driver import local_run, training
from raytrain_app.errors import BadInputError
from raytrain_app.planning import environment
from raytrain_app.planning.environment import TorchrunInfo, detect_environment


@pytest.fixture
def cuda_machine(monkeypatch):
    """This machine as one with two A100s, as far as raytrain and Ray can ask."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(environment, "local_gpu", lambda: A100)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    saved = dict(os.environ)  # a run sets Ray Train's variables
    yield
    os.environ.clear()
    os.environ.update(saved)


def _config(tmp_path, **scaling):
    cfg = fault_config(tmp_path / "runs", "device", epochs=1, dropout=0.0)
    cfg["data"]["params"]["num_samples"] = 202
    cfg["scaling"] = {"num_workers": 1, **scaling}
    return config_from_dict(cfg)


def test_use_gpu_false_trains_on_cpu_on_a_cuda_machine(cuda_machine, tmp_path):
    # Before: Ray's local mode saw CUDA, asked torch for the current CUDA device and the
    # run failed ("Torch not compiled with CUDA enabled") instead of training on CPU.
    result = training.train(_config(tmp_path, use_gpu=False), local=True, progress=False)
    assert result.summary["status"] == "completed"
    assert torch.cuda.is_available()  # the fake comes back once the run is over


def _under_torchrun(monkeypatch, rank: int, processes: int) -> None:
    env = detect_environment({})
    torchrun = TorchrunInfo(rank=rank, local_rank=rank, world_size=processes)
    monkeypatch.setattr(local_run, "detect_environment", lambda: replace(env, torchrun=torchrun))


@pytest.mark.parametrize("rank", [0, 1])
def test_more_torchrun_processes_than_gpus_are_refused_by_every_process(
    cuda_machine, monkeypatch, tmp_path, rank
):
    # Before: rank 1 crashed on torch.cuda.set_device(1)... on a machine with one GPU
    # fewer; now each process refuses before Ray's local mode sets its device.
    _under_torchrun(monkeypatch, rank, processes=3)
    with pytest.raises(BadInputError, match=r"--nproc 3 .* 2 GPU") as info:
        local_run.local_processes_config(_config(tmp_path))
    assert "scaling.use_gpu=false" in str(info.value) and "\n" not in str(info.value)


def test_torchrun_processes_on_cpu_need_no_gpu_each(cuda_machine, monkeypatch, tmp_path):
    _under_torchrun(monkeypatch, 0, processes=3)
    cfg = local_run.local_processes_config(_config(tmp_path, use_gpu=False))
    assert cfg.scaling.num_workers == 3
