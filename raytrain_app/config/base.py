"""What every config section shares: the error type, the strict base model, constrained types."""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from raytrain_app.errors import BadInputError
from raytrain_app.storage.location import has_credentials, redact_credentials

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]

# No real run comes near these; a larger value is a slip of the keyboard (a dropped "e", one
# zero too many), and the plan's divisibility checks over batch and worker counts would
# spend minutes on it instead of answering at once.
MAX_BATCH_SIZE = 1_000_000_000
MAX_WORKERS = 100_000
BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
WorkerCount = Annotated[int, Field(ge=1, le=MAX_WORKERS)]
# An elastic worker count: [min, max].
WorkerRange = Annotated[list[WorkerCount], Field(min_length=2, max_length=2)]


class ConfigError(BadInputError):
    """A bad config, file or override; ``str()`` is one sentence the CLI prints before exiting 2."""

    def __init__(self, message: str) -> None:
        # the CLI prints exactly one line, so no stray newline may survive from nested messages;
        # a value or --set flag quoted in it may be a URI with credentials, never shown
        super().__init__(redact_credentials(" ".join(message.splitlines())))


def refuse_credentials(value: str | None) -> str | None:
    """A field validator's check that a path or URI carries no ``user:password@``."""
    if value is not None and has_credentials(value):
        raise ValueError(
            "the URI carries credentials, which logs and run files would show; give it "
            "without them and pass the credentials through the environment "
            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for s3://)"
        )
    return value


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors and values are never coerced."""

    # strict: YAML already types its scalars, so coercing "yes" to a bool or 64.5 to an int
    # would only hide mistakes (ints are still accepted where floats are expected).
    # allow_inf_nan=False: YAML spells .inf and .nan as numbers, but no rate, coefficient or
    # duration of a run means anything infinite, and NaN slips past every bound (NaN > 0 is
    # as false as NaN <= 0); a disabled setting is null, never .inf.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False
    )
