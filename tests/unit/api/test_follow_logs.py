"""`raytrain submit` streams a job's logs until Ctrl-C, which stops the watching at once,
even where the log stream ignores asyncio's cancellation (as Ray's websocket stream once did
under load: `raytrain submit` went on streaming after Ctrl-C)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from raytrain_app import cli, jobs


class _Client:
    """A job whose log stream never ends and swallows every cancellation."""

    def __init__(self) -> None:
        self.released = threading.Event()  # ends the stream when the test is over

    async def tail_job_logs(self, job_id: str):
        yield f"{job_id}: epoch 1/500\n"
        while not self.released.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                continue  # the swallowed cancellation


@pytest.fixture
def stuck_stream(monkeypatch):
    client = _Client()
    monkeypatch.setattr(jobs, "_client", lambda address: client)
    monkeypatch.setattr(jobs, "submit", lambda *args, **kwargs: "raysubmit_1")
    yield client
    client.released.set()


def test_ctrl_c_stops_watching_a_job_whose_log_stream_ignores_cancellation(stuck_stream, capsys):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # tests/conftest.py
    timer = threading.Timer(0.5, signal.raise_signal, args=(signal.SIGINT,))
    started = time.monotonic()
    timer.start()
    try:
        code = cli.main(["submit", "--address", "http://head:8265", "--", "train"])
    finally:
        timer.cancel()
    assert code == 130 and time.monotonic() - started < 5
    out, err = capsys.readouterr()
    assert "raysubmit_1: epoch 1/500" in out
    assert "raysubmit_1 keeps running" in err
    assert "raytrain jobs --address http://head:8265 stop raysubmit_1" in err


def test_a_stream_that_fails_raises_in_the_caller(monkeypatch):
    class Failing:
        async def tail_job_logs(self, job_id: str):
            raise RuntimeError("WebSocket connection closed unexpectedly")
            yield  # an async generator

    monkeypatch.setattr(jobs, "_client", lambda address: Failing())
    with pytest.raises(RuntimeError, match="closed unexpectedly"):
        jobs.follow_logs("raysubmit_1", address="http://head:8265")
