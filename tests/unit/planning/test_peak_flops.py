"""The table of peak FLOP/s against faked devices (no GPU): which row a GPU name torch
reports picks, which precision column a plan reads, what a worker on a faked GPU measures
its MFU against, what it says for a GPU the table lacks and on CPU, and what
``raytrain plan`` prints."""

from __future__ import annotations

import logging

import pytest
import torch
from environments import A100, H100, T4, make_env
from torch import nn

from raytrain_app.config import config_from_dict
from raytrain_app.planning.environment import GpuInfo
from raytrain_app.planning.peak_flops import (
    PEAK_TABLE,
    peak_for,
    peak_precision,
    peak_table_markdown,
)
from raytrain_app.planning.plan_text import format_plan
from raytrain_app.planning.rules import make_plan
from raytrain_app.worker.throughput import Throughput

DOCS_PAGE = "docs/users/throughput.md"


@pytest.mark.parametrize(
    ("reported", "row"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 80GB HBM2e", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L4", "L4"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
        ("Tesla T4", "T4"),
        ("NVIDIA B200", "B200"),
        ("AMD Instinct MI300X", "MI300X"),
    ],
)
def test_each_name_torch_reports_picks_its_own_row(reported, row):
    # fp16 is the one column every row has (Volta and Turing have no bf16 or TF32).
    peak = peak_for(reported, "fp16")
    assert peak is not None and (peak.device, peak.precision) == (row, "fp16")


@pytest.mark.parametrize(
    "reported",
    ["NVIDIA A10G", "NVIDIA GH200 480GB", "NVIDIA GeForce RTX 4090", "Tesla P100-PCIE-16GB"],
)
def test_a_gpu_the_table_lacks_gets_no_peak_rather_than_a_neighbours(reported):
    # A10G is not the A10, nor GH200 the H200: a guessed peak would give a wrong MFU.
    assert peak_for(reported, "bf16") is None


def test_the_plan_reads_the_column_its_matmuls_run_at():
    assert [peak_precision(p, tf32) for p, tf32 in [("bf16", True), ("fp16", False)]] == [
        "bf16",
        "fp16",
    ]
    assert (peak_precision("fp32", True), peak_precision("fp32", False)) == ("tf32", "fp32")
    # TF32 on or off: float32 matmuls run at two different peaks of the same GPU.
    tf32, fp32 = peak_for(A100.name, "tf32"), peak_for(A100.name, "fp32")
    assert tf32.flops_per_s > fp32.flops_per_s
    assert peak_for(T4.name, "bf16") is None  # Turing has no bf16


def _faked_gpu(monkeypatch, name: str) -> torch.device:
    """A CUDA device of model ``name`` as far as the worker can tell (this host has none)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return torch.device("cuda", 0)


V100_SXM2 = GpuInfo("Tesla V100-SXM2-32GB", (7, 0), 32.0)


@pytest.mark.parametrize(
    ("gpu", "precision", "column"),
    [
        (H100, "auto", "bf16"),  # auto is bf16 from compute capability 8.0
        (V100_SXM2, "auto", "fp16"),  # and fp16 with a GradScaler on Volta
        (A100, "fp32", "fp32"),  # an explicit fp32 keeps TF32 off: the plain float32 rate
    ],
)
def test_a_worker_on_a_faked_gpu_measures_mfu_against_its_peak(
    monkeypatch, caplog, gpu, precision, column
):
    cfg = config_from_dict({"precision": precision})
    plan = make_plan(cfg, make_env(cpus=8, gpus=1, gpu=gpu))
    with caplog.at_level(logging.INFO):
        throughput = Throughput(nn.Linear(4, 4), plan, _faked_gpu(monkeypatch, gpu.name))
    peak = peak_for(gpu.name, column)
    assert throughput.peak == peak
    assert f"MFU against the {peak.describe()}" in caplog.text
    throughput.flops.value = 1e9  # FLOPs per sample, as counted
    achieved = throughput.achieved(1000.0)  # samples per second of this worker
    assert achieved == {"flops_per_s_per_worker": 1e12, "mfu": 1e12 / peak.flops_per_s}


def test_a_worker_on_a_gpu_the_table_lacks_says_so_once_and_reports_flops_only(monkeypatch, caplog):
    plan = make_plan(config_from_dict({}), make_env(cpus=8, gpus=1, gpu=H100))
    device = _faked_gpu(monkeypatch, "NVIDIA GeForce GTX 1080")
    with caplog.at_level(logging.INFO):
        throughput = Throughput(nn.Linear(4, 4), plan, device)
    lines = [r.getMessage() for r in caplog.records if "MFU" in r.getMessage()]
    assert lines == [
        "no MFU: GPU 'NVIDIA GeForce GTX 1080' is not in raytrain's table of peak FLOP/s "
        f"({DOCS_PAGE})"
    ]
    throughput.flops.value = 1e9
    assert throughput.achieved(10.0) == {"flops_per_s_per_worker": 1e10}


def test_a_worker_on_cpu_reports_flops_without_mfu_and_says_nothing(caplog):
    plan = make_plan(config_from_dict({}), make_env())
    with caplog.at_level(logging.INFO):
        throughput = Throughput(nn.Linear(4, 4), plan, torch.device("cpu"))
    assert throughput.peak is None and "MFU" not in caplog.text
    assert throughput.achieved(10.0) == {}  # nothing before the FLOPs are known
    throughput.flops.value = 2.0
    assert throughput.achieved(10.0) == {"flops_per_s_per_worker": 20.0}


def _mfu_line(cfg: dict, env) -> str:
    plan = make_plan(config_from_dict(cfg), env)
    (line,) = [line for line in format_plan(env, plan).splitlines() if line.startswith("mfu")]
    return line


def test_the_plan_shows_which_peak_it_uses():
    h100 = make_env(cpus=8, gpus=1, gpu=H100)
    plan = make_plan(config_from_dict({}), h100)
    assert plan.to_dict()["peak_flops_per_s"] == peak_for(H100.name, "bf16").flops_per_s
    assert _mfu_line({}, h100) == (
        f"mfu         : against the {peak_for(H100.name, 'bf16').describe()}"
    )
    a100 = make_env(cpus=8, gpus=1, gpu=A100)
    assert "dense fp32 peak" in _mfu_line({"precision": "fp32"}, a100)  # TF32 off
    assert _mfu_line({}, make_env()) == "mfu         : none on CPU (FLOP/s per worker only)"
    odd = make_env(cpus=8, gpus=1, gpu=GpuInfo("NVIDIA GeForce GTX 1080", (6, 1), 8.0))
    assert "none: GPU 'NVIDIA GeForce GTX 1080' is not in raytrain's table" in _mfu_line({}, odd)
    # A cluster whose GPU model the driver could not read: the workers look theirs up.
    cluster = make_env(cpus=8, gpus=4, source="ray cluster")
    assert "looked up when they start" in _mfu_line({"scaling": {"use_gpu": True}}, cluster)
    assert make_plan(config_from_dict({}), make_env()).peak_flops_per_s is None


def test_the_docs_print_the_table_the_code_uses(request):
    page = request.config.rootpath / DOCS_PAGE
    assert peak_table_markdown() in page.read_text()


def test_every_row_is_reached_by_the_name_it_documents():
    # The first match wins: a family listed before its variant would hide the variant.
    for model in PEAK_TABLE:
        assert peak_for(model.example, next(iter(model.tflops))).device == model.name
