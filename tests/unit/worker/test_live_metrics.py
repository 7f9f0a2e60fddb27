"""A worker's live Ray metrics (worker/live_metrics.py), on stand-ins of Ray's metric
classes; a real Ray's Prometheus endpoint is scraped in tests/distributed/test_train.py."""

from __future__ import annotations

import pytest

from raytrain_app.worker.live_metrics import (
    CHECKPOINT_BLOCKED,
    DATA_WAIT,
    MFU,
    SAMPLES_PER_S,
    STEP_TIME,
    LiveMetrics,
)


class _Metric:
    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys = name, tag_keys
        self.tags: dict = {}
        self.values: list[float] = []

    def set_default_tags(self, tags):
        self.tags = tags
        return self

    def set(self, value):
        self.values.append(value)

    def inc(self, value):
        self.values.append(value)


class FakeRayMetrics:
    """``ray.util.metrics``: every metric made, by name."""

    def __init__(self):
        self.made: dict[str, _Metric] = {}

    def Gauge(self, name, **kwargs):
        self.made[name] = _Metric(name, **kwargs)
        return self.made[name]

    Counter = Gauge


def test_a_worker_publishes_its_step_time_rate_data_wait_and_blocked_seconds_by_run_and_rank():
    ray_metrics = FakeRayMetrics()
    live = LiveMetrics("quickstart", 1, ray_metrics)
    # 10 steps of 64 samples in 2 s, 0.5 s of it waiting for data.
    live.interval(steps=10, seconds=2.0, data_wait_s=0.5, samples=640)
    live.checkpoint_blocked(0.25)
    made = ray_metrics.made
    assert made[STEP_TIME].values == [pytest.approx(0.2)]
    assert made[SAMPLES_PER_S].values == [pytest.approx(320.0)]
    assert made[DATA_WAIT].values == [pytest.approx(0.25)]
    assert made[CHECKPOINT_BLOCKED].values == [0.25]
    assert all(m.tags == {"run": "quickstart", "rank": "1"} for m in made.values())
    assert made[MFU].values == []  # no FLOP count known: no MFU


def test_mfu_is_published_once_the_flops_and_the_peak_are_known():
    ray_metrics = FakeRayMetrics()
    live = LiveMetrics("r", 0, ray_metrics, achieved=lambda rate: {"mfu": rate / 1000.0})
    live.interval(steps=4, seconds=1.0, data_wait_s=0.0, samples=100)
    assert ray_metrics.made[MFU].values == [pytest.approx(0.1)]


def test_without_ray_nothing_is_published_and_nothing_fails():
    live = LiveMetrics.on_ray("r", 0)  # this process never connected to Ray
    live.interval(steps=4, seconds=1.0, data_wait_s=0.1, samples=100)
    live.checkpoint_blocked(1.0)


def test_the_loop_publishes_its_live_numbers_and_mfu_from_its_flop_count(tmp_path, monkeypatch):
    """The in-process loop with stand-ins for Ray's metrics and a GPU's peak: every
    interval sets the step time, the rate and the data-wait share, and MFU from the FLOPs
    counted on the first micro-batch (worker.throughput)."""
    from loop_harness import LocalSession, make_task, run_loop

    from raytrain_app.worker import telemetry
    from raytrain_app.worker.throughput import Throughput

    ray_metrics = FakeRayMetrics()
    monkeypatch.setattr(
        LiveMetrics,
        "on_ray",
        classmethod(lambda cls, run, rank, achieved=None: cls(run, rank, ray_metrics, achieved)),
    )
    monkeypatch.setattr(telemetry, "INTERVAL_S", 0.0)  # every step
    peak = 1.0e9  # FLOP/s of the stand-in device
    counted = Throughput.achieved

    def with_peak(self, rate):
        return {"mfu": counted(self, rate)["flops_per_s_per_worker"] / peak}

    monkeypatch.setattr(Throughput, "achieved", with_peak)
    run_loop(make_task(tmp_path, epochs=1), LocalSession(tmp_path / "ckpt"))
    made = ray_metrics.made
    assert len(made[STEP_TIME].values) >= 16 and min(made[STEP_TIME].values) > 0
    assert all(0 <= share <= 1 for share in made[DATA_WAIT].values)
    # MFU is the FLOPs per sample x samples/s over the peak: in step with the rate.
    rates, mfus = made[SAMPLES_PER_S].values, made[MFU].values
    assert len(mfus) == len(rates) and mfus[0] > 0
    ratios = [mfu / rate for rate, mfu in zip(rates, mfus, strict=True)]
    assert ratios == pytest.approx([ratios[0]] * len(ratios))
    assert made[CHECKPOINT_BLOCKED].values  # the epoch's checkpoint blocked the step
