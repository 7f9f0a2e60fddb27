"""The run directory's resume-or-refuse rule: an earlier run is never silently overwritten."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_app.config import config_from_dict, load_config
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.errors import BadInputError
from raytrain_app.planning.environment import detect_environment
from raytrain_app.planning.rules import make_plan, resolve_config


def resolved(tmp_path: Path, *overrides: str):
    """A config with no ``auto`` left, as ``train`` resolves it before checking the directory."""
    data = {
        "experiment": {"name": "exp1", "output_dir": str(tmp_path / "runs")},
        "scaling": {"num_workers": 2, "use_gpu": False},
        "distributed": {"strategy": "ddp", "backend": "gloo"},
        "precision": "fp32",
        "dataloader": {"num_workers": 0, "pin_memory": False},
    }
    return config_from_dict(data, overrides)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_for_config_is_output_dir_slash_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict({"experiment": {"name": "exp1", "output_dir": "runs"}})
    run = RunDirectory.for_config(cfg)
    assert run.root == tmp_path / "runs" / "exp1"
    assert run.config == run.root / "config.yaml"
    assert run.checkpoints == run.root / "checkpoints"


def test_new_directory_is_not_a_resume_and_is_not_created(tmp_path):
    cfg = resolved(tmp_path)
    run = RunDirectory.for_config(cfg)
    assert run.check_resumable(cfg) is False
    assert not run.root.exists()


def test_existing_empty_directory_is_not_a_resume(tmp_path):
    cfg = resolved(tmp_path)
    run = RunDirectory.for_config(cfg)
    run.root.mkdir(parents=True)
    assert run.check_resumable(cfg) is False


def test_same_config_resumes(tmp_path):
    run = RunDirectory.for_config(resolved(tmp_path))
    run.write_config(resolved(tmp_path))
    assert load_config(run.config) == resolved(tmp_path)  # config.yaml re-runs as is
    assert run.check_resumable(resolved(tmp_path)) is True


def test_different_config_is_refused_and_the_run_is_untouched(tmp_path):
    run = RunDirectory.for_config(resolved(tmp_path))
    run.write_config(resolved(tmp_path))
    (run.root / "metrics.csv").write_text("epoch,step\n1,10\n")
    before = snapshot(run.root)
    with pytest.raises(BadInputError) as info:
        run.check_resumable(resolved(tmp_path, "train.lr=0.01"))
    message = str(info.value)
    assert "\n" not in message
    assert "train.lr" in message and "exp1" in message and "experiment.name" in message
    assert snapshot(run.root) == before


def test_many_differences_are_summarised_on_one_line(tmp_path):
    run = RunDirectory.for_config(resolved(tmp_path))
    run.write_config(resolved(tmp_path))
    changed = resolved(
        tmp_path, "train.lr=0.01", "train.epochs=9", "train.warmup_steps=3", "experiment.seed=4"
    )
    with pytest.raises(BadInputError) as info:
        run.check_resumable(changed)
    message = str(info.value)
    assert "\n" not in message and "..." in message


def test_non_empty_directory_without_config_is_refused(tmp_path):
    cfg = resolved(tmp_path)
    run = RunDirectory.for_config(cfg)
    run.root.mkdir(parents=True)
    (run.root / "notes.txt").write_text("mine")
    with pytest.raises(BadInputError) as info:
        run.check_resumable(cfg)
    message = str(info.value)
    assert "config.yaml" in message and str(run.root) in message
    assert (run.root / "notes.txt").read_text() == "mine"
    assert not run.config.exists()


def test_unreadable_config_is_refused_with_one_line(tmp_path):
    cfg = resolved(tmp_path)
    run = RunDirectory.for_config(cfg)
    run.root.mkdir(parents=True)
    run.config.write_text("train: [unclosed\n")
    with pytest.raises(BadInputError) as info:
        run.check_resumable(cfg)
    assert "\n" not in str(info.value) and "config.yaml" in str(info.value)


def test_max_failures_may_change_on_resume(tmp_path):
    run = RunDirectory.for_config(resolved(tmp_path))
    run.write_config(resolved(tmp_path))
    assert run.check_resumable(resolved(tmp_path, "fault_tolerance.max_failures=10")) is True


def test_summary_round_trip(tmp_path):
    run = RunDirectory.for_config(resolved(tmp_path))
    run.root.mkdir(parents=True)
    run.write_summary({"checkpoint": "/x", "world_size": 2})
    assert run.read_summary() == {"checkpoint": "/x", "world_size": 2}
    assert sorted(p.name for p in run.root.iterdir()) == ["summary.json"]


SECRETS = {
    "RAY_AUTH_TOKEN": "ray-token-4f1c9e",
    "WANDB_API_KEY": "wandb-key-77ab01",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-9d3e5c",
}


def written_config(tmp_path: Path) -> str:
    """config.yaml as ``train`` writes it: environment → plan → resolved config → disk."""
    cfg = load_config(overrides=[f"experiment.output_dir={tmp_path / 'runs'}"])
    resolved = resolve_config(cfg, make_plan(cfg, detect_environment()))
    run = RunDirectory.for_config(resolved)
    run.write_config(resolved)
    return run.config.read_text()


def test_the_written_config_holds_no_secrets_from_the_environment(tmp_path, monkeypatch):
    for name in SECRETS:
        monkeypatch.delenv(name, raising=False)
    clean = written_config(tmp_path)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    with_secrets = written_config(tmp_path)
    assert with_secrets == clean  # built from the config alone
    for name, value in SECRETS.items():
        assert value not in with_secrets and name not in with_secrets
