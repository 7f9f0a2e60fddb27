"""What a resume reads from the run directory besides checkpoints is data: the run's
``config.yaml`` and MLflow's file store, each edited to carry a YAML tag that would run a
process if loaded with PyYAML's full loader. The payloads only ever create a marker file."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from raytrain_app.config import config_from_dict
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.errors import BadInputError
from raytrain_app.tracking.trackers import open_tracker


def _resolved(tmp_path):
    """A config with no ``auto`` left, as ``train`` checks the run directory with."""
    data = {
        "experiment": {"name": "exp1", "output_dir": str(tmp_path / "runs")},
        "scaling": {"num_workers": 1, "use_gpu": False},
        "distributed": {"strategy": "ddp", "backend": "gloo"},
        "precision": "fp32",
        "dataloader": {"num_workers": 0, "pin_memory": False},
    }
    return config_from_dict(data)


def _tag(marker) -> str:
    return f"!!python/object/apply:os.system ['touch {marker}']"


def test_a_resume_reads_the_runs_config_yaml_without_running_its_tags(tmp_path):
    cfg = _resolved(tmp_path)
    run = RunDirectory.for_config(cfg)
    run.write_config(cfg)
    marker = tmp_path / "marker"
    run.config.write_text(run.config.read_text() + f"hook: {_tag(marker)}\n")

    with pytest.raises(BadInputError, match="unreadable config.yaml") as refused:
        run.check_resumable(cfg)

    assert "\n" not in str(refused.value) and not marker.exists()


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="pip install '.[mlflow]'")
def test_a_resumed_mlflow_run_reads_its_file_store_without_running_its_tags(tmp_path, caplog):
    """MLflow reads its store's ``meta.yaml`` files with its safe loader: the edited run
    fails to load, the run goes on without MLflow, nothing runs."""
    raw = {"experiment": {"name": "trk", "output_dir": str(tmp_path)}}
    cfg = config_from_dict({**raw, "tracking": {"tensorboard": False, "mlflow": True}})
    first = open_tracker(cfg, tmp_path, resumed_step=0, rank_zero=True)
    first.log_step(1, {"loss": 0.5})
    first.close(failed=True)
    [meta] = [p for p in (tmp_path / "mlruns").glob("*/*/meta.yaml")]
    marker = tmp_path / "marker"
    meta.write_text(meta.read_text() + f"hook: {_tag(marker)}\n")

    with caplog.at_level(logging.WARNING, logger="raytrain_app.tracking.trackers"):
        open_tracker(cfg, tmp_path, resumed_step=1, rank_zero=True).close()

    assert "mlflow could not start" in caplog.text and "python/object" in caplog.text
    assert not marker.exists()
