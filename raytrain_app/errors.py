"""The two kinds of failure a user sees, and the exit codes the CLI maps them to."""


class BadInputError(ValueError):
    """The user's input (config, flag, path, data) is wrong; exit code 2, nothing was run.

    The message is one sentence that names the key, flag or file and says how to fix it.
    """

    exit_code = 2


class RunFailedError(RuntimeError):
    """The run itself failed after it started; exit code 1."""

    exit_code = 1


class RunStoppedError(RunFailedError):
    """The run stopped early on request (a preemption or time-limit signal, or Ctrl-C) after
    writing a checkpoint; exit code 75 (EX_TEMPFAIL, "try again", which the SLURM script turns
    into a requeue), or 130 after Ctrl-C. Re-running the same command resumes it.
    """

    exit_code = 75

    def __init__(self, message: str, interrupted: bool = False) -> None:
        super().__init__(message)
        if interrupted:  # Ctrl-C: the shell's usual code for an interrupted command
            self.exit_code = 130


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line (its type's name when it says nothing): what a
    one-line error quotes of a library's multi-line message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
