"""Failures raised inside Ray's workers, turned into the one-line errors a user sees."""

from __future__ import annotations

import re

from raytrain_app.errors import BadInputError, RunFailedError


def _root_cause(exc: BaseException) -> BaseException:
    """The user's exception inside Ray's wrappers (worker group / task errors)."""
    seen = exc
    for _ in range(10):
        inner = getattr(seen, "cause", None) or seen.__cause__
        if hasattr(seen, "worker_failures"):
            failures = list(seen.worker_failures.values())
            inner = failures[0] if failures else inner
        if inner is None or inner is seen:
            return seen
        seen = inner
    return seen


# How gloo and NCCL word a collective that waited past the process group's timeout.
_COLLECTIVE_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def user_facing_error(exc: BaseException, timeout_s: int | None = None) -> Exception:
    """One-line error for a failure raised inside Ray workers, keeping our own error kinds."""
    cause = _root_cause(exc)
    if isinstance(cause, BadInputError | RunFailedError):
        return cause
    if timeout_s is not None and _COLLECTIVE_TIMEOUT.search(str(cause)):
        return RunFailedError(
            f"a collective operation waited longer than distributed.timeout_s={timeout_s} s, "
            f"so a worker stalled, hung or died; look for the stalled rank in the worker logs, "
            f"or raise distributed.timeout_s if a step legitimately takes that long"
        )
    return RunFailedError(f"training failed: {type(cause).__name__}: {cause}".splitlines()[0])
