"""The ``raytrain`` console script: plan output, exit codes and one-line errors, no Ray started.

Subprocess tests run the real entry point (``python -m raytrain_app.cli``); they are started
together by one module fixture because each pays ~2 s of torch/Ray imports. The many
bad-input cases run in-process through ``cli.main`` with ``ray.init`` replaced, so a test
fails (instead of hanging or starting a cluster) if the CLI reaches Ray. ``train`` makes its
plan only after starting Ray, so its plan errors run against a stand-in embedded Ray.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from contract import PLAN_JSON_KEYS

from raytrain_app import cli
from raytrain_app.config import ConfigError
from raytrain_app.driver import executors, ray_connection
from raytrain_app.planning.environment import Resources

# Caught by load_config, before the driver (and Ray) is touched: (--set or flags, message part).
CONFIG_ERRORS = {
    "unknown_key": (["--set", "train.lrr=1"], "did you mean 'train.lr'"),
    "bad_value": (["--set", "train.lr=abc"], "train.lr"),
    "missing_config_file": (["--config", "does/not/exist.yaml"], "does/not/exist.yaml"),
    "set_without_equals": (["--set", "train.lr"], "KEY=VALUE"),
}
# Caught by the plan (pure functions of config + resources).
PLAN_ERRORS = {
    "batch_not_divisible": (["--set", "train.global_batch_size=65"], "e.g. 64 or 66"),
    "too_many_workers": (["--set", "scaling.num_workers=64"], "scaling.num_workers=64"),
    "fp16_on_cpu": (["--set", "precision=fp16"], "precision=fp16"),
    "data_parallel": (["--set", "distributed.strategy=dp"], "distributed.strategy"),
}


def _small_cpu_machine() -> bool:
    import torch

    return not torch.cuda.is_available() and 2 <= len(os.sched_getaffinity(0)) < 64


# The quickstart asks for 2 workers; the expected plans assume a CPU-only machine that hosts them.
needs_cpu_machine = pytest.mark.skipif(
    not _small_cpu_machine(), reason="expects a CPU-only machine with 2 to 63 CPUs"
)


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def no_ray(monkeypatch, tmp_path):
    """Run in an empty cwd with ``ray.init`` recording calls instead of starting Ray."""
    calls = []

    def fake_init(*args, **kwargs):
        calls.append(kwargs)
        raise AssertionError("the CLI started Ray for input it should reject first")

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # even if a test Ray is up
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    return calls


@pytest.fixture
def embedded_ray(monkeypatch, tmp_path):
    """Stand in for the embedded Ray that ``train`` starts: the same resources, as Ray reports.

    ``ray.init(num_cpus=<this machine's CPUs>)`` makes a cluster that reports those CPUs
    with ``source="ray cluster"``; the trainer itself must never be reached here.
    """
    started = []
    # The distributed tests' session-wide Ray may be up; train() must see none here.
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(k))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(
        ray_connection,
        "ray_cluster_resources",
        lambda: (
            Resources(cpus=started[-1]["num_cpus"], gpus=0, nodes=1, source="ray cluster"),
            None,
        ),
    )

    def trainer_started(*args, **kwargs):
        raise TrainerStarted

    monkeypatch.setattr(executors, "run_trainer", trainer_started)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    saved_environ = dict(os.environ)  # train() sets Ray Train's variables; undo that
    yield started
    os.environ.clear()
    os.environ.update(saved_environ)


class TrainerStarted(Exception):
    """Raised by the stand-in trainer: bad input got past every check."""


def _one_error_line(stderr: str, *parts: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    for part in parts:
        assert part in lines[0]
    return lines[0]


# --------------------------------------------------------------------------- real console script

SUBPROCESS_RUNS = {
    "plan_json_split": [
        "plan",
        "--set",
        "train.global_batch_size=128",
        "--set",
        "train.max_batch_per_worker=16",
        "--set",
        "scaling.num_workers=2",
        "--json",
    ],
    "train_unknown_key": ["train", "--set", "train.lrr=1"],
    "debug_bad_value": ["--debug", "train", "--set", "train.lr=abc"],
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Run every SUBPROCESS_RUNS entry concurrently, each in its own empty cwd."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    procs = {}
    for name, args in SUBPROCESS_RUNS.items():
        cwd = tmp_path_factory.mktemp(name)
        # A started Ray would leave <RAY_TMPDIR>/ray/session_*; the tests look for it.
        (cwd / "raytmp").mkdir()
        proc = subprocess.Popen(
            [sys.executable, "-m", "raytrain_app.cli", *args],
            cwd=cwd,
            env={**env, "RAY_TMPDIR": str(cwd / "raytmp")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs[name] = (proc, cwd, time.monotonic())
    results = {}
    for name, (proc, cwd, start) in procs.items():
        try:
            # A bound on a hang, not a speed check: in CI's compatibility tier these three
            # start together in the idle CPU class beside the main suite, and one that had
            # printed its plan was killed at 60 s before its interpreter had exited.
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = (proc.returncode, out, err, cwd, time.monotonic() - start)
    return results


@needs_cpu_machine
def test_plan_json_is_one_object_with_the_batch_split(cli_runs):
    code, out, err, _, _ = cli_runs["plan_json_split"]
    assert code == 0, err
    plan = json.loads(out)  # the whole of stdout is one JSON document
    assert isinstance(plan, dict)
    assert plan.keys() >= PLAN_JSON_KEYS
    assert (plan["world_size"], plan["per_worker_batch_size"], plan["grad_accum_steps"]) == (
        2,
        16,
        4,
    )
    assert plan["effective_batch_size"] == 128
    assert (plan["precision"], plan["backend"], plan["strategy"]) == ("fp32", "gloo", "ddp")
    assert plan["lr"] == pytest.approx(1e-3)


def test_train_with_bad_config_exits_2_quickly_and_writes_nothing(cli_runs):
    code, out, err, cwd, _ = cli_runs["train_unknown_key"]
    assert code == 2
    _one_error_line(err, "train.lrr", "did you mean 'train.lr'")
    assert out == ""
    assert not (cwd / "raytmp" / "ray").exists()  # refused before starting Ray
    assert not (cwd / "runs").exists()


def test_debug_shows_the_traceback(cli_runs):
    code, _, err, _, _ = cli_runs["debug_bad_value"]
    assert code != 0
    assert "Traceback" in err
    assert "ConfigError" in err and "train.lr" in err


# --------------------------------------------------------------------------- in-process main()


@needs_cpu_machine
def test_plan_prints_the_human_plan(no_ray, capsys, tmp_path):
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "workers     : 2 on cpu" in out
    assert "batch       : 32 per worker x 2 workers x 1 accumulation = 64 effective" in out
    assert "precision   : fp32" in out
    assert "distributed : ddp over gloo" in out
    assert "lr          : 0.001" in out
    assert no_ray == []
    assert list(tmp_path.iterdir()) == []  # plan writes nothing


@needs_cpu_machine
def test_plan_json_in_process(no_ray, capsys):
    assert cli.main(["plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan.keys() >= PLAN_JSON_KEYS
    assert plan["effective_batch_size"] == 64
    assert plan["per_worker_batch_size"] * plan["world_size"] * plan["grad_accum_steps"] == 64
    assert no_ray == []


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_config_errors_exit_2_before_ray(no_ray, capsys, tmp_path, command, case):
    flags, part = CONFIG_ERRORS[case]
    assert cli.main([command, *flags]) == 2
    captured = capsys.readouterr()
    _one_error_line(captured.err, part)
    assert captured.out == ""
    assert no_ray == []
    assert list(tmp_path.iterdir()) == []


def test_missing_config_file_message_names_the_flag(no_ray, capsys):
    assert cli.main(["plan", "--config", "nope.yaml"]) == 2
    _one_error_line(capsys.readouterr().err, "nope.yaml", "--config")


def test_unknown_builtin_set_value_is_rejected_with_allowed_values(no_ray, capsys):
    assert cli.main(["plan", "--set", "precision=fp8"]) == 2
    _one_error_line(capsys.readouterr().err, "precision", "fp32", "bf16")


@needs_cpu_machine
# `raytrain plan` previews any worker count (a warning, exit 0); train refuses it.
@pytest.mark.parametrize("case", sorted(set(PLAN_ERRORS) - {"too_many_workers"}))
def test_plan_errors_exit_2_with_one_line(no_ray, capsys, tmp_path, case):
    flags, part = PLAN_ERRORS[case]
    assert cli.main(["plan", *flags]) == 2
    captured = capsys.readouterr()
    _one_error_line(captured.err, part)
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_plan_previews_more_workers_than_this_machine_hosts(no_ray, capsys, tmp_path):
    assert cli.main(["plan", "--json", "--set", "scaling.num_workers=64"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert (printed["world_size"], printed["per_worker_batch_size"]) == (64, 1)
    assert printed["fits"] is False
    assert "scaling.num_workers=64 needs more than the" in captured.err
    assert "Traceback" not in captured.err
    assert list(tmp_path.iterdir()) == []
    assert cli.main(["plan", "--set", "scaling.num_workers=64"]) == 0
    assert "more than can be hosted now" in capsys.readouterr().out


@needs_cpu_machine
@pytest.mark.parametrize("case", sorted(PLAN_ERRORS))
def test_train_plan_errors_exit_2_and_write_nothing(embedded_ray, capsys, tmp_path, case):
    # too_many_workers guards a regression: nothing can join the embedded Ray, so 64 workers
    # must be refused now rather than written to a run directory and waited for forever.
    flags, part = PLAN_ERRORS[case]
    small_data = ["--set", "data.params.num_turbines=1", "--set", "data.params.num_hours=500"]
    assert cli.main(["train", "--no-progress", *flags, *small_data]) == 2
    _one_error_line(capsys.readouterr().err, part)
    assert not (tmp_path / "runs").exists()


def test_batch_error_suggests_valid_sizes(no_ray, capsys):
    assert (
        cli.main(["plan", "--set", "scaling.num_workers=2", "--set", "train.global_batch_size=65"])
        == 2
    )
    line = _one_error_line(capsys.readouterr().err)
    assert "multiple of 2" in line and "64 or 66" in line


def test_debug_reraises_in_process(no_ray):
    with pytest.raises(ConfigError, match="train.lrr"):
        cli.main(["--debug", "plan", "--set", "train.lrr=1"])


def test_predict_missing_checkpoint_exits_2_with_one_line(no_ray, capsys, tmp_path):
    assert cli.main(["predict", "--checkpoint", "/nonexistent"]) == 2
    _one_error_line(capsys.readouterr().err, "/nonexistent", "--checkpoint")
    assert not Path(tmp_path / "predictions.parquet").exists()


@needs_cpu_machine
def test_raytrain_plan_prints_the_range_and_every_sizes_split(capsys):
    args = ["plan", "--set", "scaling.num_workers=[1,2]", "--set", "train.global_batch_size=64"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "workers     : 1 to 2 (elastic)" in text
    assert "workers x micro-batch x accumulation = 1 x 64 x 1, 2 x 32 x 1" in text
    assert cli.main([*args, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["worker_range"] == [1, 2] and shown["effective_batch_size"] == 64


def test_version_names_raytrain_ray_torch_and_python(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out.strip()
    assert re.fullmatch(
        r"raytrain \S+, ray 2\.\d+\.\d+\S*, torch 2\.\d+\.\d+\S*, python 3\.\d+\.\d+", shown
    ), shown


def test_train_ends_with_where_the_wall_time_went(monkeypatch, capsys, tmp_path):
    from raytrain_app.driver import training
    from raytrain_app.driver.goodput import GOODPUT_PARTS

    goodput = dict.fromkeys(GOODPUT_PARTS, 0.0)
    goodput.update(compute_s=30.0, startup_s=7.5, data_wait_s=2.5)
    summary = {
        "final_metrics": {"epoch": 1, "train_loss": 0.5, "val_loss": 0.4},
        "effective_batch_size": 64,
        "world_size": 2,
        "per_worker_batch_size": 32,
        "grad_accum_steps": 1,
        "precision": "fp32",
        "samples_per_s": 100.0,
        "wall_time_s": 40.0,
        "checkpoint": str(tmp_path / "checkpoint"),
        "goodput": goodput,
    }
    finished = training.TrainResult(run_dir=tmp_path, summary=summary)
    monkeypatch.setattr(training, "train", lambda cfg, **kwargs: finished)
    assert cli.main(["train"]) == 0
    assert "time          : compute 75%, start-up 19%, data wait 6%" in capsys.readouterr().out
