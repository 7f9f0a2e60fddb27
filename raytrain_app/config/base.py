"""What every config section shares: the error type, the strict base model, constrained types."""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from raytrain_app.errors import BadInputError

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# An elastic worker count: [min, max].
WorkerRange = Annotated[list[PositiveInt], Field(min_length=2, max_length=2)]


class ConfigError(BadInputError):
    """A bad config, file or override; ``str()`` is one sentence the CLI prints before exiting 2."""

    def __init__(self, message: str) -> None:
        # the CLI prints exactly one line, so no stray newline may survive from nested messages
        super().__init__(" ".join(message.splitlines()))


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors and values are never coerced."""

    # strict: YAML already types its scalars, so coercing "yes" to a bool or 64.5 to an int
    # would only hide mistakes (ints are still accepted where floats are expected)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)
