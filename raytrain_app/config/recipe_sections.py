"""The user's training recipe inside ``train``: optimizer by import path, learning-rate
schedule and early stopping (``planning/recipe.py`` checks the classes they name)."""

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrain_app.config.base import NonNegativeInt, PositiveInt, _Section

_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
# Parameter kinds no_weight_decay accepts besides name patterns (planning/recipe.py).
PARAM_KINDS = ("bias", "norm", "embedding")


def _importable(value: str | None) -> str | None:
    if value is not None and not _TARGET.fullmatch(value):
        raise ValueError("must look like 'package.module:Class' (e.g. 'torch.optim:SGD')")
    return value


class OptimizerConfig(_Section):
    """An optimizer class by import path; lr always comes from the plan."""

    target: str = Field(
        description="torch.optim.Optimizer subclass as 'package.module:Class', e.g. "
        "'torch.optim:SGD' or a user's class."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the class besides lr and weight_decay (set "
        "train.lr and train.weight_decay instead), e.g. {momentum: 0.9, nesterov: true}.",
    )

    @field_validator("target")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        return _importable(value)


class ScheduleConfig(_Section):
    """The learning-rate schedule after warmup, stepped once per optimizer step."""

    name: Literal["cosine", "linear", "constant", "step", "multistep", "onecycle"] | None = Field(
        "cosine",
        description="cosine (to min_lr_ratio), linear (to min_lr_ratio), constant, step "
        "(x gamma every step_size units), multistep (x gamma at each milestone), onecycle; "
        "cleared when target is given.",
    )
    target: str | None = Field(
        None,
        description="A torch.optim.lr_scheduler class as 'package.module:Class' instead of a "
        "name; stepped per optimizer step, so its params count optimizer steps.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of target's class."
    )
    unit: Literal["epoch", "step"] = Field(
        "epoch", description="What milestones and step_size count: epochs or optimizer steps."
    )
    milestones: list[PositiveInt] = Field(
        default_factory=list, description="multistep: where lr is multiplied by gamma."
    )
    step_size: PositiveInt | None = Field(
        None, description="step: lr is multiplied by gamma every step_size units."
    )
    gamma: float = Field(0.1, gt=0, le=1, description="step/multistep: the decay factor.")
    pct_start: float = Field(
        0.3, gt=0, lt=1, description="onecycle: fraction of the steps spent rising to the peak."
    )

    @field_validator("target")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        return _importable(value)

    @model_validator(mode="after")
    def _one_kind(self) -> "ScheduleConfig":
        """A target replaces the default name; multistep/step need their positions."""
        if self.target is not None and "name" not in self.model_fields_set:
            self.__dict__["name"] = None  # bypass validate_assignment inside validation
        if (self.target is None) == (self.name is None):
            raise ValueError("set exactly one of name and target")
        if self.name == "multistep" and not self.milestones:
            raise ValueError("multistep needs milestones, e.g. [30, 60]")
        if self.name == "multistep" and self.milestones != sorted(set(self.milestones)):
            raise ValueError(f"milestones must increase, got {self.milestones}")
        if self.name == "step" and self.step_size is None:
            raise ValueError("step needs step_size")
        return self


class EarlyStoppingConfig(_Section):
    """Stop when train.monitor has not improved for patience epochs."""

    patience: PositiveInt = Field(
        description="Epochs without an improvement of train.monitor after which the run stops."
    )
    min_delta: float = Field(
        0.0, ge=0, description="How much better than the best a value must be to count."
    )
    min_epochs: NonNegativeInt = Field(0, description="Never stop before this many epochs.")


def parse_schedule(value: Any) -> Any:
    """``schedule: linear`` is short for ``schedule: {name: linear}``."""
    return {"name": value} if isinstance(value, str) else value


def check_no_weight_decay(values: list[str]) -> list[str]:
    """Kinds or fnmatch name patterns; an empty pattern matches nothing and is a slip."""
    if any(not v for v in values):
        raise ValueError(f"names a parameter kind ({', '.join(PARAM_KINDS)}) or a name pattern")
    return values
