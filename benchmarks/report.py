"""The markdown table of a results dict: one row per benchmark, figure vs goal."""

from __future__ import annotations

from typing import Any

# How each benchmark's headline figure reads in the table.
_LABELS = {
    "loop_overhead": "Loop overhead: raytrain 1 worker / plain PyTorch (s per step)",
    "ddp_parity": "DDP parity: raytrain 2 workers / torchrun 2 procs (s per epoch)",
    "first_step": "Time to first step, cold `raytrain train` (s)",
    "data_wait": "Data wait: share of step time waiting for the batch",
    "streaming": "Streaming from S3: data wait share (samples/s vs a Ray Data loop)",
    "tune_overhead": "Tune overhead: sweep wall / (per-trial time x trials / concurrency)",
    "scaling": "Scaling: per-worker efficiency at the most workers",
    "checkpoint_stall": "Checkpoint stall: steps lost per checkpoint, 100M model, 2 CPU workers",
    "forecast_quality": "Forecast quality: model MAE / best naive MAE, worst real series",
    "gpu": "GPU: raytrain bf16 / hand-tuned loop; GPU busy share",
}


def _figure(name: str, record: dict[str, Any]) -> str:
    if "error" in record:
        return "error: " + record["error"].splitlines()[0][:60]
    if "skipped" in record:
        return "skipped: " + record["skipped"]
    figure = record.get("figure", record.get("ratio"))
    unit = record.get("figure_unit", "")
    if unit == "%":
        text = f"{figure:.1f} %"
    elif unit == "s":
        text = f"{figure:.1f} s"
    else:
        text = f"{figure:.3f}"
    if record.get("secondary"):
        text += f" ({record['secondary']})"
    return text


def _status(record: dict[str, Any]) -> str:
    met = record.get("goal_met")
    if met is None:
        return "—"
    return "met" if met else "**missed**"


def _speed(meta: dict[str, Any]) -> str:
    """The machine's speed at the start, where the run measured it (older results did not)."""
    spent = meta.get("import_torch_cpu_s")
    return f", `import torch` {spent:.2f} s of user CPU" if spent is not None else ""


def markdown_table(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"Machine `{meta['machine']}` ({meta['cpus']} CPUs, GPU: {meta.get('cuda') or 'none'}), "
        f"torch {meta['torch']}, ray {meta['ray']}, {meta['date']}{_speed(meta)}; median of "
        f"{meta['repeats']} interleaved repeats{', quick mode' if meta.get('quick') else ''}.",
        "",
        "| benchmark | figure | goal | status |",
        "| --- | --- | --- | --- |",
    ]
    for name, record in results.items():
        lines.append(
            f"| {_LABELS.get(name, name)} | {_figure(name, record)} | "
            f"{record.get('goal') or '—'} | {_status(record)} |"
        )
    return "\n".join(lines)
