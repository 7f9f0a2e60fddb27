"""A worker's account of its time (worker/goodput.py), on a fake clock and fake device
events, and from the real loop in this process."""

from __future__ import annotations

import pytest
import torch
from loop_harness import LocalSession, make_task, run_loop

from raytrain_app.tracking.metrics_log import GOODPUT_COLUMNS
from raytrain_app.worker.goodput import EventSpans, Goodput, HostSpans, spans_for
from raytrain_app.worker.telemetry import StepTelemetry


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SlowBatches:
    """Batches that take ``wait`` seconds of the fake clock to arrive."""

    def __init__(self, clock: FakeClock, count: int, wait: float) -> None:
        self.clock, self.count, self.wait = clock, count, wait

    def __iter__(self):
        for index in range(self.count):
            self.clock.advance(self.wait)
            yield index


def _account(clock: FakeClock) -> Goodput:
    return Goodput(HostSpans(clock), clock=clock, wall=lambda: 1_000.0 + clock())


def test_data_waits_compute_validation_and_checkpoints_fill_the_interval():
    clock = FakeClock()
    goodput = _account(clock)
    goodput.begin(step=10)
    batches = goodput.timed(SlowBatches(clock, count=4, wait=0.5))
    for step in (11, 12):  # two steps of two micro-batches, 1 s of compute each
        for _ in range(2):
            next(batches)
            clock.advance(0.5)
        goodput.step_done(step)
        clock.advance(0.1)  # the loop's bookkeeping between steps
    with goodput.timing("validation_s"):
        clock.advance(0.7)
    goodput.add_checkpoint_blocked(0.3)
    clock.advance(0.3)
    columns = goodput.epoch_columns()
    assert columns == pytest.approx(
        {
            "time_data_wait_s": 2.0,
            "time_compute_s": 2.0,
            "time_checkpoint_s": 0.3,
            "time_validation_s": 0.7,
            "time_other_s": 0.2,
        }
    )
    assert tuple(columns) == GOODPUT_COLUMNS
    record = goodput.record()
    assert record["elapsed_s"] == pytest.approx(5.2) == sum(record["parts"].values())
    assert (record["first_step"], record["step"], record["steps"]) == (10, 12, 2)
    assert record["at"] - record["began_at"] == pytest.approx(5.2)


def test_each_epochs_columns_cover_the_time_since_the_previous_row():
    clock = FakeClock()
    goodput = _account(clock)
    goodput.begin(step=0)
    clock.advance(1.0)
    first = goodput.epoch_columns()
    batches = goodput.timed(SlowBatches(clock, count=1, wait=0.25))
    next(batches)
    clock.advance(2.0)
    goodput.step_done(1)
    second = goodput.epoch_columns()
    assert first["time_other_s"] == pytest.approx(1.0)
    assert second == pytest.approx(
        {
            "time_data_wait_s": 0.25,
            "time_compute_s": 2.0,
            "time_checkpoint_s": 0.0,
            "time_validation_s": 0.0,
            "time_other_s": 0.0,
        }
    )


class FakeEvent:
    """A device timing event: recorded at the fake clock's time, complete once the fake
    device has got that far (``device.done``)."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.device.queued

    def query(self) -> bool:
        return self.device.done >= self.at

    def synchronize(self) -> None:
        self.device.syncs += 1
        self.device.done = max(self.device.done, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as torch's


class FakeDevice:
    """A stream the host queues work on (``queued``, seconds of device time) and that
    runs behind it (``done``)."""

    def __init__(self) -> None:
        self.queued = self.done = 0.0
        self.syncs = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)


def test_device_spans_are_read_once_the_device_passed_them_and_never_waited_for_per_step():
    device = FakeDevice()
    spans = EventSpans(device.event)
    for _ in range(3):  # three steps of 2 s of kernels each, queued far ahead of the device
        spans.open()
        device.queued += 2.0
        spans.close()
    assert spans.resolve(wait=False) == 0.0  # the device has run none of them yet
    device.done = 4.0  # it finished the first two
    assert spans.resolve(wait=False) == pytest.approx(4.0)
    assert device.syncs == 0  # reading never waited for the device
    assert spans.resolve(wait=True) == pytest.approx(6.0)  # at a report: waits for the last
    assert device.syncs == 1


def test_device_compute_past_the_hosts_interval_is_capped_so_the_parts_still_sum():
    """Kernels queued in an interval may run after it: compute is what the interval's
    other parts leave."""
    clock, device = FakeClock(), FakeDevice()
    goodput = Goodput(EventSpans(device.event), clock=clock, wall=clock)
    goodput.begin(step=0)
    batches = goodput.timed(SlowBatches(clock, count=1, wait=0.5))
    next(batches)
    device.queued += 3.0  # 3 s of kernels queued in 0.25 s of host time
    clock.advance(0.25)
    goodput.step_done(1)
    columns = goodput.epoch_columns()
    assert columns["time_compute_s"] == pytest.approx(0.25)
    assert sum(columns.values()) == pytest.approx(0.75)


def test_the_cpu_is_timed_on_the_host_and_an_accelerator_with_its_events():
    assert isinstance(spans_for(torch.device("cpu")), HostSpans)
    assert isinstance(spans_for(torch.device("cuda", 0)), EventSpans)  # no event made yet


class FakeDriver:
    """The driver's run control: what rank 0 sent it."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.account = self

    def remote(self, record: dict) -> None:
        self.sent.append(record)


def test_rank_zero_tells_the_driver_its_step_before_a_checkpoint_blocks_it(tmp_path):
    """A worker killed while saving: the driver knows the step it had reached, so the
    steps trained again after the restore are counted as lost work."""
    task = make_task(tmp_path)
    driver = FakeDriver()
    telemetry = StepTelemetry(task, task.plan, 16, 3, torch.device("cpu"), _no_metrics(), driver)
    telemetry.begin(step=5)
    assert driver.sent[-1]["first_step"] == 5
    telemetry.goodput.step_done(9)
    with telemetry.reporting(due=True):
        assert driver.sent[-1]["step"] == 9
    assert telemetry.goodput.parts["checkpoint_s"] > 0
    with telemetry.reporting(due=False):  # a report without a checkpoint blocks nothing
        pass
    assert len(driver.sent) == 2


def _no_metrics():
    from raytrain_app.worker.live_metrics import LiveMetrics

    return LiveMetrics("run", 0)


def test_the_loop_accounts_for_its_time_in_its_result_and_every_epoch_row(tmp_path):
    session = LocalSession(tmp_path / "ckpt")
    result, _ = run_loop(make_task(tmp_path, checkpoint_every_steps=5, epochs=2), session)
    account = result["goodput"]
    parts = account["parts"]
    assert sum(parts.values()) == pytest.approx(account["elapsed_s"], rel=1e-9)
    assert (account["first_step"], account["step"], account["steps"]) == (0, 32, 32)
    assert min(parts["compute_s"], parts["checkpoint_s"], parts["validation_s"]) > 0
    history = result["history"]
    for row in history:
        assert all(row[column] >= 0 for column in GOODPUT_COLUMNS), row
        # The epoch's training time holds its steps: their compute and data waits, and the
        # loop's bookkeeping between them.
        stepping = row["time_compute_s"] + row["time_data_wait_s"]
        assert stepping <= row["epoch_time_s"] * 1.01
    assert sum(sum(row[c] for c in GOODPUT_COLUMNS) for row in history) <= account["elapsed_s"]
    # Checkpoints every 5 steps and at each epoch's end, each counted.
    assert sum(row["time_checkpoint_s"] for row in history) > 0
