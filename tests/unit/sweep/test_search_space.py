"""tune.param_space: every distribution maps to Ray Tune, every bad space fails before Ray."""

from __future__ import annotations

import pytest
import ray
from ray import tune

from raytrain_app import cli
from raytrain_app.config import ConfigError, config_from_dict, load_config
from raytrain_app.sweep.search_space import build_search_space, trial_config


def space_of(param_space: dict, **tune_keys) -> dict:
    return build_search_space(config_from_dict({"tune": {"param_space": param_space, **tune_keys}}))


def test_every_distribution_becomes_a_tune_domain():
    space = space_of(
        {
            "train.lr": {"loguniform": [1e-4, 1e-2]},
            "model.params.dropout": {"uniform": [0.0, 0.3]},
            "train.min_lr_ratio": {"quniform": [0.0, 0.5, 0.1]},
            "train.warmup_steps": {"randint": [0, 100]},
            "train.global_batch_size": {"choice": [32, 64]},
            "model.params.d_model": {"grid": [32, 64]},
            "train.epochs": 2,
        }
    )
    assert isinstance(space["train.lr"], tune.search.sample.Float)
    assert space["train.warmup_steps"].upper == 101  # inclusive in YAML, exclusive in Tune
    assert space["train.global_batch_size"].categories == [32, 64]
    assert space["model.params.d_model"] == {"grid_search": [32, 64]}
    assert space["train.epochs"] == 2


def test_a_sampled_trial_config_is_a_complete_validated_config():
    base = config_from_dict({"experiment": {"name": "sweep"}})
    cfg = trial_config(base, {"train.lr": 3e-4, "model.params.d_model": 64})
    assert cfg.train.lr == 3e-4 and cfg.model.params == {"d_model": 64}
    assert cfg.experiment.name == "sweep"


def test_grid_search_turns_choices_into_grids():
    space = space_of({"train.global_batch_size": {"choice": [32, 64]}}, search="grid")
    assert space["train.global_batch_size"] == {"grid_search": [32, 64]}


@pytest.mark.parametrize(
    ("param_space", "tune_keys", "message"),
    [
        ({}, {}, "tune.param_space is empty"),
        ({"train.lrr": {"choice": [1e-3]}}, {}, "did you mean 'train.lr'"),
        ({"train.lr": {"lognormal": [1, 2]}}, {}, "unknown distribution 'lognormal'"),
        ({"train.lr": {"loguniform": [0, 1]}}, {}, "loguniform needs low > 0"),
        ({"train.lr": {"uniform": [1, 0]}}, {}, "low < high"),
        ({"train.lr": {"uniform": [0.1]}}, {}, "uniform takes [low, high]"),
        ({"train.lr": {"quniform": [0.1, 1, 0]}}, {}, "q > 0"),
        ({"train.warmup_steps": {"randint": [0.5, 3]}}, {}, "integer bounds"),
        ({"train.lr": {"choice": []}}, {}, "non-empty list"),
        ({"train.lr": {"choice": 3}}, {}, "takes a list"),
        ({"train.lr": {"choice": [1], "grid": [2]}}, {}, "must be one distribution"),
        ({"train.global_batch_size": {"choice": [32, -1]}}, {}, "train.global_batch_size"),
        ({"train.global_batch_size": {"uniform": [16, 64]}}, {}, "train.global_batch_size"),
        ({"precision": {"choice": ["fp8"]}}, {}, "precision"),
        ({"train.lr": {"grid": [1e-3, 1e-2]}}, {"search": "optuna"}, "optuna"),
        ({"train.lr": {"uniform": [1e-3, 1e-2]}}, {"search": "grid"}, "tune.search=grid"),
    ],
)
def test_bad_spaces_are_one_line_config_errors(param_space, tune_keys, message):
    with pytest.raises(ConfigError) as info:
        space_of(param_space, **tune_keys)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_rejects_a_bad_space_with_exit_2_before_starting_ray(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["tune", "--set", "tune.param_space={train.lr: {loguniform: [0, 1]}}"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "loguniform" in err[0]
    assert not (tmp_path / "runs").exists()


def test_the_builtin_sweep_is_valid():
    from raytrain_app.config import BUILTIN_SWEEP

    cfg = load_config(None, builtin=BUILTIN_SWEEP)
    assert len(build_search_space(cfg)) == 5 and cfg.tune.num_samples == 8


def test_optuna_search_without_optuna_names_the_extra(monkeypatch):
    import importlib.util

    from raytrain_app.sweep.tuner import search_algorithm as _search_algorithm

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "optuna" else real_find_spec(name, *a),
    )
    cfg = config_from_dict({"tune": {"search": "optuna"}})
    with pytest.raises(ConfigError, match=r"raytrain_app\[optuna\]"):
        _search_algorithm(cfg)
