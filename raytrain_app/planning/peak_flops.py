"""Dense peak FLOP/s per GPU model and precision: what MFU is measured against.

MFU (model FLOPs utilisation) is the FLOP/s a worker achieves over its device's peak at
the run's precision. Every figure is the vendor's dense peak of one GPU at boost clock:
NVIDIA's datasheets print tensor-core rates "with sparsity", twice the dense rate, so
those are halved here. bf16 and fp16 are the tensor-core rates, tf32 the tensor-core rate
of float32 matmuls with TF32 on (the plan's ``tf32``), fp32 the plain float32 rate.

A GPU is named by the string torch reports (``torch.cuda.get_device_name``); the first
pattern below that matches it picks the row. A GPU or precision not here gets no MFU,
never a guessed one. The table is printed in docs/users/throughput.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class Peak:
    """One GPU model's dense peak at one precision."""

    device: str  # the table's name for the model, e.g. "H100 SXM"
    precision: str  # bf16 | fp16 | tf32 | fp32
    flops_per_s: float

    def describe(self) -> str:
        return (
            f"{self.device} dense {self.precision} peak, {self.flops_per_s / TERA:g} TFLOP/s "
            f"per GPU"
        )


@dataclass(frozen=True)
class _Model:
    name: str
    example: str  # a name torch reports for it
    pattern: str  # a regular expression, matched case-insensitively anywhere in the name
    tflops: dict[str, float]  # precision -> dense TFLOP/s


# Ordered: the first match wins, so a variant comes before its family (H100 NVL before
# H100). \b keeps L4 from matching L40S and A10 from matching A100 or A10G.
PEAK_TABLE: tuple[_Model, ...] = (
    # NVIDIA Blackwell datasheet (HGX B200, per GPU): FP16/BF16 4.5 PF with sparsity, as
    # torchtitan takes it. Its TF32 and FP32 rates are left out: no MFU rather than a
    # figure not checked against a datasheet.
    _Model("B200", "NVIDIA B200", r"\bB200\b", {"bf16": 2250.0, "fp16": 2250.0}),
    # NVIDIA H200 datasheet: H200 NVL FP32 60, TF32 835*, BF16/FP16 1671* (*sparsity).
    _Model(
        "H200 NVL",
        "NVIDIA H200 NVL",
        r"\bH200\b.*\bNVL\b",
        {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    ),
    # NVIDIA H200 datasheet: H200 SXM FP32 67, TF32 989*, BF16/FP16 1979*: the H100 SXM's
    # rates (same GH100 chip and clocks), taken from the whitepaper as for the H100 SXM.
    _Model(
        "H200 SXM",
        "NVIDIA H200",
        r"\bH200\b",
        {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    ),
    # NVIDIA H100 datasheet: H100 NVL FP32 60, TF32 835*, BF16/FP16 1671* (*sparsity).
    _Model(
        "H100 NVL",
        "NVIDIA H100 NVL",
        r"\bH100\b.*\bNVL\b",
        {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    ),
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 1 (dense | sparse):
    # H100 PCIe FP32 51.2, TF32 378 | 756, BF16/FP16 756 | 1513; the 80GB HBM2e board is
    # the PCIe card.
    _Model(
        "H100 PCIe",
        "NVIDIA H100 PCIe",
        r"\bH100\b.*\b(?:PCIe|HBM2e)\b",
        {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    ),
    # Same whitepaper: H100 SXM5 FP32 66.9, TF32 494.7 | 989.4, BF16/FP16 989.4 | 1978.9.
    # torch names it "NVIDIA H100 80GB HBM3".
    _Model(
        "H100 SXM",
        "NVIDIA H100 80GB HBM3",
        r"\bH100\b",
        {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    ),
    # NVIDIA A100 datasheet: SXM and PCIe alike, FP32 19.5, TF32 156 | 312*, BF16/FP16
    # 312 | 624*.
    _Model(
        "A100",
        "NVIDIA A100-SXM4-80GB",
        r"\bA100\b",
        {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    ),
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5 | 125*, BF16/FP16 125 | 250*. AWS's A10G
    # is another chip configuration with no NVIDIA datasheet: not in the table.
    _Model(
        "A10", "NVIDIA A10", r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}
    ),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183 | 366*, BF16/FP16 362.05 | 733*.
    _Model(
        "L40S",
        "NVIDIA L40S",
        r"\bL40S\b",
        {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    ),
    # NVIDIA L40 datasheet: FP32 90.5, TF32 90.5 | 181*, BF16/FP16 181.05 | 362.1*.
    _Model(
        "L40",
        "NVIDIA L40",
        r"\bL40\b",
        {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    ),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120*, BF16/FP16 242* (sparsity only).
    _Model(
        "L4", "NVIDIA L4", r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}
    ),
    # NVIDIA V100 datasheet: tensor (fp16) 130 / 125 / 112, FP32 16.4 / 15.7 / 14 for
    # V100S PCIe / V100 SXM2 / V100 PCIe. Volta has no bf16 or TF32.
    _Model("V100S PCIe", "Tesla V100S-PCIE-32GB", r"\bV100S\b", {"fp16": 130.0, "fp32": 16.4}),
    _Model("V100 SXM2", "Tesla V100-SXM2-32GB", r"\bV100-SXM2\b", {"fp16": 125.0, "fp32": 15.7}),
    _Model("V100 PCIe", "Tesla V100-PCIE-16GB", r"\bV100-PCIE\b", {"fp16": 112.0, "fp32": 14.0}),
    # NVIDIA T4 datasheet: FP16 tensor 65, FP32 8.1. Turing has no bf16 or TF32.
    _Model("T4", "Tesla T4", r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    # AMD Instinct MI300X data sheet (dense): BF16/FP16 1307.4, TF32 653.7, FP32 matrix
    # 163.4.
    _Model(
        "MI300X",
        "AMD Instinct MI300X",
        r"\bMI300X\b",
        {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    ),
)


def peak_precision(precision: str, tf32: bool) -> str:
    """The column of the table a run's matmuls run at: bf16 and fp16 autocast use those
    tensor-core rates; fp32 runs at the TF32 rate when the plan turns TF32 on."""
    if precision in ("bf16", "fp16"):
        return precision
    return "tf32" if tf32 else "fp32"


def table_row(device_name: str) -> _Model | None:
    """The table's row for the GPU torch names ``device_name``; None when it has none."""
    for model in PEAK_TABLE:
        if re.search(model.pattern, device_name, flags=re.IGNORECASE):
            return model
    return None


def peak_for(device_name: str, precision: str) -> Peak | None:
    """The dense peak of the GPU ``device_name`` at ``precision`` (``peak_precision``);
    None when the table has no such GPU or no such rate for it."""
    model = table_row(device_name)
    if model is None or precision not in model.tflops:
        return None
    return Peak(model.name, precision, model.tflops[precision] * TERA)


def no_peak_reason(device_name: str, precision: str) -> str:
    """Why ``peak_for`` found nothing, in the words of a log line or the plan."""
    model = table_row(device_name)
    if model is None:
        return (
            f"GPU {device_name!r} is not in raytrain's table of peak FLOP/s "
            f"(docs/users/throughput.md)"
        )
    return f"the table has no dense {precision} peak for the {model.name}"


def plan_peak(
    use_gpu: bool, gpu_name: str | None, precision: str, tf32: bool
) -> tuple[float | None, str]:
    """The peak a run's MFU is measured against, and the plan's line saying which.

    Args:
        gpu_name: the workers' GPU as the plan knows it; None when it does not (the
            workers look theirs up when they start).
    """
    if not use_gpu:
        return None, "none on CPU (FLOP/s per worker only)"
    if gpu_name is None:
        return None, "against the peak of the workers' GPU, looked up when they start"
    key = peak_precision(precision, tf32)
    peak = peak_for(gpu_name, key)
    if peak is None:
        return None, f"none: {no_peak_reason(gpu_name, key)}"
    return peak.flops_per_s, f"against the {peak.describe()}"


def peak_table_markdown() -> str:
    """The table as docs/users/throughput.md prints it: dense TFLOP/s per GPU."""
    columns = ("bf16", "fp16", "tf32", "fp32")
    lines = [
        "| GPU | torch reports, e.g. | " + " | ".join(columns) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    for model in PEAK_TABLE:
        rates = [f"{model.tflops[c]:g}" if c in model.tflops else "-" for c in columns]
        lines.append(f"| {model.name} | {model.example} | " + " | ".join(rates) + " |")
    return "\n".join(lines)
