"""The two kinds of failure a user sees, and the exit codes the CLI maps them to."""


class BadInputError(ValueError):
    """The user's input (config, flag, path, data) is wrong; exit code 2, nothing was run.

    The message is one sentence that names the key, flag or file and says how to fix it.
    """

    exit_code = 2


class RunFailedError(RuntimeError):
    """The run itself failed after it started; exit code 1."""

    exit_code = 1
