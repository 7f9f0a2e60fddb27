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
        self.streaming = threading.Event()  # the watching has begun: Ctrl-C may come

    async def tail_job_logs(self, job_id: str):
        self.streaming.set()
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
    pressed: list[float] = []

    def ctrl_c_once_watching() -> None:
        # not at a fixed delay: on a loaded machine the SIGINT came before cli.main was
        # watching, and interrupted pytest itself (CI's compatibility tier)
        if stuck_stream.streaming.wait(60):
            time.sleep(0.5)
            pressed.append(time.monotonic())
            signal.raise_signal(signal.SIGINT)

    user = threading.Thread(target=ctrl_c_once_watching, daemon=True)
    user.start()
    code = cli.main(["submit", "--address", "http://head:8265", "--", "train"])
    user.join(5)
    assert pressed, "the job's logs were never watched"
    assert code == 130 and time.monotonic() - pressed[0] < 4.5  # as 0.5 s + 4.5 s before
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
