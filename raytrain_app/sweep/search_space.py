"""``tune.param_space``: dotted config keys → Ray Tune distributions, checked before any trial.

The YAML form is ``{"train.lr": {loguniform: [1e-4, 1e-2]}, "model.params.d_model":
{choice: [32, 64]}, "train.warmup_steps": {randint: [0, 100]}}``; a plain value is a
constant. Every value a distribution can produce is validated by the same schema as
``raytrain train``, so a bad space fails with exit code 2 before Ray starts a trial.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ray import tune

from raytrain_app.config import ConfigError, RaytrainConfig, config_with_values

_LABEL = "tune.param_space"


def _two_numbers(name: str, key: str, args: list) -> tuple[float, float]:
    if len(args) != 2 or not all(isinstance(a, int | float) for a in args) or args[0] >= args[1]:
        raise ConfigError(
            f"{_LABEL}['{key}']: {name} takes [low, high] with low < high, got {args!r}"
        )
    return args[0], args[1]


def _loguniform(key: str, args: list) -> Any:
    low, high = _two_numbers("loguniform", key, args)
    if low <= 0:
        raise ConfigError(f"{_LABEL}['{key}']: loguniform needs low > 0, got {args!r}")
    return tune.loguniform(low, high)


def _uniform(key: str, args: list) -> Any:
    return tune.uniform(*_two_numbers("uniform", key, args))


def _quniform(key: str, args: list) -> Any:
    if len(args) != 3 or not all(isinstance(a, int | float) for a in args) or args[2] <= 0:
        raise ConfigError(
            f"{_LABEL}['{key}']: quniform takes [low, high, q] with q > 0, got {args!r}"
        )
    return tune.quniform(*_two_numbers("quniform", key, args[:2]), args[2])


def _randint(key: str, args: list) -> Any:
    low, high = _two_numbers("randint", key, args)
    if not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{_LABEL}['{key}']: randint takes integer bounds, got {args!r}")
    return tune.randint(low, high + 1)  # YAML bounds are inclusive, Tune's high is not


def _values(name: str, key: str, args: list) -> list:
    if not args:
        raise ConfigError(f"{_LABEL}['{key}']: {name} needs a non-empty list of values")
    return args


DISTRIBUTIONS: dict[str, Callable[[str, list], Any]] = {
    "loguniform": _loguniform,
    "uniform": _uniform,
    "quniform": _quniform,
    "randint": _randint,
    "choice": lambda key, args: tune.choice(_values("choice", key, args)),
    "grid": lambda key, args: tune.grid_search(_values("grid", key, args)),
}


def _domain(key: str, spec: Any) -> Any:
    if not isinstance(spec, Mapping):
        return spec  # a constant
    if len(spec) != 1:
        raise ConfigError(
            f"{_LABEL}['{key}'] must be one distribution like {{choice: [32, 64]}}, got "
            f"{dict(spec)!r}"
        )
    ((name, args),) = spec.items()
    if name not in DISTRIBUTIONS:
        raise ConfigError(
            f"{_LABEL}['{key}']: unknown distribution '{name}'; use one of "
            f"{', '.join(DISTRIBUTIONS)}"
        )
    if not isinstance(args, list):
        raise ConfigError(f"{_LABEL}['{key}']: {name} takes a list, got {args!r}")
    return DISTRIBUTIONS[name](key, args)


def _candidates(domain: Any) -> list:
    """Values to validate: both ends of a range, every value of a choice or grid."""
    if isinstance(domain, dict) and "grid_search" in domain:
        return list(domain["grid_search"])
    if isinstance(domain, tune.search.sample.Categorical):
        return list(domain.categories)
    if isinstance(domain, tune.search.sample.Integer):
        return [domain.lower, domain.upper - 1]
    if isinstance(domain, tune.search.sample.Float):
        # Tune samples floats even from integer bounds; check what it will really produce.
        return [float(domain.lower), float(domain.upper)]
    return [domain]


def build_search_space(cfg: RaytrainConfig) -> dict[str, Any]:
    """Ray Tune's ``param_space`` for ``cfg.tune.param_space``, every value pre-validated.

    Raises:
        ConfigError: unknown key, bad distribution, or a value the schema rejects.
    """
    if not cfg.tune.param_space:
        raise ConfigError(
            f"{_LABEL} is empty; add at least one key to sweep, e.g. "
            "tune.param_space: {train.lr: {loguniform: [1.0e-4, 1.0e-2]}}"
        )
    space = {key: _domain(key, spec) for key, spec in cfg.tune.param_space.items()}
    for key, domain in space.items():
        for value in _candidates(domain):
            config_with_values(cfg, {key: value}, _LABEL)
    has_grid = any(isinstance(d, dict) and "grid_search" in d for d in space.values())
    if cfg.tune.search == "optuna" and has_grid:
        raise ConfigError(
            f"{_LABEL} uses grid values, which tune.search=optuna cannot sample; use choice "
            "instead, or tune.search: grid"
        )
    if cfg.tune.search == "grid":
        not_grid = [
            k
            for k, d in space.items()
            if isinstance(d, tune.search.sample.Domain)
            and not isinstance(d, tune.search.sample.Categorical)
        ]
        if not_grid:
            raise ConfigError(
                f"tune.search=grid needs grid or choice values, but {_LABEL}['{not_grid[0]}'] "
                "is a range; use {grid: [...]} or tune.search: random"
            )
        space = {
            k: tune.grid_search(list(d.categories))
            if isinstance(d, tune.search.sample.Categorical)
            else d
            for k, d in space.items()
        }
    return space


def trial_config(base: RaytrainConfig, sampled: Mapping[str, Any]) -> RaytrainConfig:
    """The complete train config of one trial: ``base`` with the sampled values."""
    return config_with_values(base, dict(sampled), _LABEL)
