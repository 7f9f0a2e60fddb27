"""The driver's progress bars, drawn from rank 0's snapshots (no Ray needed)."""

from __future__ import annotations

import io

from log_lines import log_lines

from raytrain_app.driver.progress import EpochBars, ProgressLines, progress_for


def snapshot(epoch: int, step: int, loss: float = 0.5, workers: int = 2) -> dict:
    return {"epoch": epoch, "epochs": 3, "step": step, "steps": 200, "loss": loss,
            "samples_per_s": 1000.0, "workers": workers}  # fmt: skip


def shown(out: io.StringIO) -> str:
    """What the terminal shows now: tqdm redraws its line after a carriage return."""
    return out.getvalue().rsplit("\r", 1)[-1]


def test_an_epoch_first_seen_mid_way_starts_there_without_an_instant_rate():
    out = io.StringIO()
    bars = EpochBars(file=out, mininterval=0)
    bars.show(snapshot(1, 28))
    assert "28/200" in shown(out)
    # The 28 steps were done before the driver looked, not in the bar's first microsecond.
    assert "?step/s" in shown(out)
    bars.show(snapshot(1, 120, loss=0.25))
    assert "120/200" in shown(out) and "loss=0.2500" in shown(out)
    bars.close()


def test_each_epoch_gets_its_own_bar_and_the_finished_one_stays():
    out = io.StringIO()
    bars = EpochBars(file=out, mininterval=0)
    bars.show(snapshot(1, 200))
    bars.show(snapshot(2, 15))
    bars.close()
    text = out.getvalue()
    assert "epoch 1/3" in text and "200/200" in text
    assert "epoch 2/3" in text and "15/200" in text


def test_the_bar_shows_how_many_workers_train_now():
    out = io.StringIO()
    bars = EpochBars(file=out, mininterval=0)
    bars.show(snapshot(1, 10, workers=2))
    assert "workers=2" in shown(out)
    bars.show(snapshot(1, 20, workers=1))  # an elastic run lost a worker
    assert "workers=1" in shown(out)
    bars.close()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_a_plain_line_every_interval_and_a_terminal_a_bar():
    assert isinstance(progress_for(_Terminal()), EpochBars)
    lines = progress_for(io.StringIO())  # a SLURM .out file, a Ray job's logs
    assert isinstance(lines, ProgressLines)
    with log_lines("raytrain_app.driver.progress") as seen:
        lines.interval_s = 0.0
        lines.show(snapshot(2, 120, loss=0.25, workers=1))
        lines.interval_s = 3600.0
        lines.show(snapshot(2, 121))  # within the interval: nothing
    assert seen == ["epoch 2/3: step 120/200, loss 0.2500, 1000 samples/s, 1 worker(s)"]
