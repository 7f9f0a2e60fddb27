"""The Python API a notebook drives: ``rt.plan`` stays callable, and ``rt.train`` /
``rt.tune`` refuse a wrong model or data source as the CLI does, before Ray starts."""

from __future__ import annotations

import pytest
import ray

import raytrain_app as rt
from raytrain_app.errors import BadInputError


def test_plan_can_be_called_again_as_a_rerun_notebook_cell_does():
    cfg = rt.load_config(overrides=["train.epochs=1"])
    first = rt.plan(cfg)
    second = rt.plan(cfg)  # `raytrain_app.plan` was once rebound to a submodule here
    assert first == second
    assert first.effective_batch_size == cfg.train.global_batch_size


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if anything tries to start or reach Ray."""

    def refuse(*args, **kwargs):
        raise AssertionError("bad input got as far as ray.init")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.target=no_such_pkg.models:build", "model.target"),
        ("data.name=no_such_data", "data.name"),
    ],
)
@pytest.mark.parametrize("entry", ["train", "tune"])
def test_train_and_tune_check_the_sources_before_ray_starts(
    tmp_path, no_ray, entry, override, message
):
    overrides = [f"experiment.output_dir={tmp_path}", override]
    with pytest.raises(BadInputError, match=message):
        getattr(rt, entry)(overrides=overrides)
    assert list(tmp_path.iterdir()) == []  # nothing written
