"""The driver's stop signals: a request the run control passes on, and handlers put back."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import ray

from raytrain_app import cli
from raytrain_app.driver import training
from raytrain_app.driver.signals import STOP_SIGNALS, stop_on_signals
from raytrain_app.errors import RunStoppedError


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_stop_signal_requests_a_stop_and_a_second_interrupts(sig):
    stop = threading.Event()
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with stop_on_signals(stop) as received:
        os.kill(os.getpid(), sig)
        assert received == [signal.Signals(sig).name]
        assert stop.is_set()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGUSR1", 75), ("SIGTERM", 75)])
def test_a_stopped_run_exits_130_after_ctrl_c_and_75_after_a_preemption_signal(
    monkeypatch, capsys, sig, code
):
    def stopped(*args, **kwargs):
        raise RunStoppedError(f"stopped on request ({sig}) ...", interrupted=sig == "SIGINT")

    monkeypatch.setattr(training, "train", stopped)
    # The embedded Ray begun beside the driver's imports (ray_connection) is stood in.
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert cli.main(["train", "--no-progress"]) == code
    err = capsys.readouterr().err
    assert f"stopped on request ({sig})" in err and "Traceback" not in err
