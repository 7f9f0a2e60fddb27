"""What every config section shares: the error type, the strict base model, constrained types."""

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from raytrain_app.errors import BadInputError
from raytrain_app.storage.location import (
    credentials_advice,
    has_credentials,
    redact_credentials,
    uri_scheme,
)

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


def _with_credentials(value: Any, where: str = "") -> tuple[str, str] | None:
    """The first string in ``value`` (nested mappings and lists walked) holding a URI with
    credentials, and where it sits below the key (``['db']['url']``; '' for the value)."""
    if isinstance(value, str):
        return (where, value) if has_credentials(value) else None
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for inner, item in items:
        found = _with_credentials(item, f"{where}[{inner!r}]")
        if found:
            return found
    return None


# An MLflow server's credentials: MLflow's client reads these (a database's go by scheme).
_MLFLOW_VARIABLES = (
    "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
)


def refuse_credentials(value: Any, info: ValidationInfo) -> Any:
    """The one rule for every key of the config: no URI in it carries ``user:password@``
    or a token (the config is written to config.yaml, every checkpoint's meta.json and
    Tune's results); the message says which variables take the credentials instead."""
    found = _with_credentials(value)
    if found is None:
        return value
    where, text = found
    server = info.field_name == "mlflow_tracking_uri" and uri_scheme(text) in ("http", "https")
    advice = credentials_advice(text, _MLFLOW_VARIABLES if server else None)
    raise ValueError(f"{where} = {redact_credentials(repr(text))}: {advice}" if where else advice)


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

    # Every key of every section, free-form params and swept values included.
    _no_credentials = field_validator("*")(refuse_credentials)
