"""Ray job submission: run ``raytrain train|tune`` on a running cluster, and manage the jobs.

Everything goes through Ray's ``JobSubmissionClient``: the working directory (with the
config and any user code in it) travels as the job's ``runtime_env`` and the entrypoint
is the same ``raytrain`` command, run on the head node.

A job's runtime env is readable by anyone holding the cluster's token (the dashboard shows
it), so it carries only the variables the user names (``--env-var``) and those the stores
the config names need (``planning.store_variables``): the AWS variables that authenticate
and locate S3 when any location is in S3, MLflow's when it logs to an MLflow server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import shlex
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from raytrain_app.driver.reachability import check_reachable
from raytrain_app.errors import BadInputError, first_line
from raytrain_app.planning.environment import (
    enable_client_token_auth,
    job_server_address,
    variables_set,
)

logger = logging.getLogger(__name__)

TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
SUBMITTABLE = ("train", "tune")
# Never uploaded: environments, VCS data, earlier runs and caches are not worth it; token
# files and dotenv files are secrets (cluster/README.md keeps the cluster token in
# cluster/ray-token), and the job's files are readable on the head by whoever holds the token.
_EXCLUDES = [
    ".git",
    ".venv",
    "venv",
    "runs",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
    "ray-token",
    "*.token",
    "auth_token",
    ".env",
    ".env.*",
    ".envrc",
]
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _client(address: str | None) -> Any:
    resolved = job_server_address(address)
    if not resolved:
        raise BadInputError(
            "no Ray cluster to submit to; pass --address http://HEAD:8265 or set "
            "RAY_API_SERVER_ADDRESS"
        )
    # Ray's client retries a dead address for a long time and then fails in many lines.
    check_reachable(
        resolved,
        source="--address" if address else "RAY_API_SERVER_ADDRESS/RAY_ADDRESS",
        what="a Ray job server",
        hint="start the cluster or pass its dashboard address, e.g. --address http://HEAD:8265",
        default_scheme="http",
    )
    # Before importing Ray's client: it reads the auth mode once.
    has_token = enable_client_token_auth()
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(resolved)
    except AuthenticationError:
        hint = "the token given was refused" if has_token else "no token was given"
        raise BadInputError(
            f"the Ray cluster at {resolved} requires token authentication and {hint}; set "
            f"RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH to the cluster's token file) and retry"
        ) from None
    except ConnectionError as exc:
        raise BadInputError(
            f"cannot reach a Ray job server at {resolved} ({first_line(exc)}); check "
            f"--address (the dashboard address, e.g. http://HEAD:8265)"
        ) from None


def _job_call(address: str | None, job_id: str, method: str, *args: Any) -> Any:
    client = _client(address)
    try:
        return getattr(client, method)(job_id, *args)
    except RuntimeError as exc:
        if "does not exist" in str(exc) or "404" in str(exc):
            raise BadInputError(
                f"job '{job_id}' does not exist on this cluster; list jobs with "
                f"'raytrain jobs list'"
            ) from None
        raise


def _parse(command: Sequence[str]) -> argparse.Namespace:
    """``command`` parsed as ``raytrain`` will parse it on the cluster (any spelling argparse
    accepts); a flag it would refuse is refused here, before anything is sent."""
    from raytrain_app.cli_flags import parse_submitted_command

    return parse_submitted_command(command)


def _config_replaced(args: Sequence[str], path: str) -> list[str]:
    """``args`` with each ``--config``/``-c`` and its value replaced by ``--config path``, in
    place, in each spelling argparse takes: ``--config P``, ``--config=P``, a prefix such as
    ``--conf P``, ``-c P``, ``-cP``, ``-c=P``."""
    replaced: list[str] = []
    value_follows = False
    for arg in args:
        if value_follows:
            value_follows = False
            continue
        name = arg.split("=", 1)[0]
        if arg == "-c" or (len(name) > 2 and "--config".startswith(name)):
            value_follows = "=" not in arg
            replaced += ["--config", path]
        elif arg.startswith("-c"):
            replaced += ["--config", path]
        else:
            replaced.append(arg)
    return replaced


def _job_config_path(config: str, working_dir: Path) -> str:
    """``--config``'s path relative to the working dir the job runs in."""
    path = Path(config).expanduser().resolve()
    if not path.is_file():
        raise BadInputError(
            f"--config '{config}' does not exist; pass an existing YAML file inside the "
            f"working directory sent with the job"
        )
    try:
        return str(path.relative_to(working_dir))
    except ValueError:
        raise BadInputError(
            f"--config '{config}' is outside the working directory '{working_dir}' that is "
            f"sent with the job; move it there or pass --working-dir"
        ) from None


def _job_command(command: list[str], working_dir: Path) -> tuple[list[str], argparse.Namespace]:
    """The command the job runs, its ``--config`` rewritten relative to ``working_dir``, and
    the command as parsed here."""
    parsed = _parse(command)
    if parsed.config is None:
        return command, parsed
    relative = _job_config_path(parsed.config, working_dir)
    rewritten = [command[0], *_config_replaced(command[1:], relative)]
    # What the job will parse must be what was checked here, whatever the spelling.
    if vars(_parse(rewritten)) != {**vars(parsed), "config": relative}:
        raise BadInputError(
            "cannot rewrite the command's --config for the job; write it as --config PATH"
        )
    return rewritten, parsed


def _named_variables(names: Sequence[str]) -> dict[str, str]:
    """The variables of this shell that ``--env-var`` names."""
    named = variables_set(names)
    for name in names:
        if "=" in name:
            # The value is not echoed: it may well be a secret.
            shown = name.split("=", 1)[0]
            raise BadInputError(
                f"--env-var takes a variable's name, not '{shown}=...'; export {shown} "
                f"in this shell and pass --env-var {shown}"
            )
        if not _VARIABLE_NAME.fullmatch(name):
            raise BadInputError(
                f"--env-var {name!r} is not a variable name; pass the name of a variable set "
                f"in this shell (letters, digits and '_')"
            )
        if name not in named:
            raise BadInputError(
                f"--env-var {name} is not set in this shell; export {name} first, or drop "
                f"--env-var {name}"
            )
    return named


def _store_variables(cfg: Any) -> dict[str, str]:
    """What the job needs of this shell to reach the stores the config ``cfg`` names, as
    ``storage_env_vars`` decides for workers and trials (names logged, never values)."""
    from raytrain_app.planning.store_variables import (
        S3_VARIABLES,
        s3_keys,
        storage_env_vars,
        store_schemes,
    )

    sent, on_s3 = storage_env_vars(cfg), " and ".join(s3_keys(cfg))
    for_s3 = [name for name in sent if name in S3_VARIABLES]
    if on_s3 and for_s3:
        logger.info("%s in S3: the job gets this shell's %s", on_s3, ", ".join(for_s3))
    elif on_s3:
        logger.info(
            "%s in S3 and no AWS variables set here: the job uses the cluster's own S3 access",
            on_s3,
        )
    if for_mlflow := [name for name in sent if name not in S3_VARIABLES]:
        logger.info(
            "tracking.mlflow_tracking_uri is an MLflow server: the job gets this shell's %s",
            ", ".join(for_mlflow),
        )
    # Web addresses (an MLflow server, a factory's URL) and local files are no stores here.
    others = {
        key: scheme
        for key, schemes in store_schemes(cfg).items()
        for scheme in sorted(schemes - {"s3", "file", "http", "https"})
    }
    _log_other_stores(others)
    return sent


def _log_other_stores(schemes: dict[str, str]) -> None:
    """Say that a store other than S3 gets no credentials from here, and how to send some."""
    for key, scheme in schemes.items():
        # gs://: GOOGLE_APPLICATION_CREDENTIALS names a file on this machine, not the cluster.
        store = "Google Cloud Storage" if scheme in ("gs", "gcs") else f"{scheme}://"
        logger.info(
            "%s is in %s: no credentials go with the job, which uses the cluster's own; pass "
            "--env-var NAME for a variable it needs",
            key,
            store,
        )


def _job_variables(parsed: argparse.Namespace, names: Sequence[str]) -> dict[str, str]:
    """The job's environment variables: those named, and what its stores need."""
    from raytrain_app.config import BUILTIN_SWEEP, load_config

    named = _named_variables(names)
    config = Path(parsed.config).expanduser().resolve() if parsed.config else None
    if parsed.command == "tune":
        cfg = load_config(config, parsed.overrides, builtin=BUILTIN_SWEEP)
    else:
        cfg = load_config(config, parsed.overrides)
    variables = {**_store_variables(cfg), **named}
    if named:
        logger.info("the job gets this shell's %s (--env-var)", ", ".join(named))
    return variables


def submit(
    command: Sequence[str],
    *,
    address: str | None = None,
    working_dir: str = ".",
    wait: bool = True,
    write: Callable[[str], Any] | None = None,
    env_vars: Sequence[str] = (),
) -> str:
    """Submit ``raytrain <command>`` as a Ray job; return its id.

    Args:
        command: the raytrain arguments, e.g. ``["train", "--set", "train.epochs=3"]``.
        address: the cluster's dashboard address; defaults to RAY_API_SERVER_ADDRESS or
            RAY_ADDRESS.
        working_dir: uploaded with the job and used as its working directory.
        wait: stream the job's logs through ``write`` (default: stdout) until it ends.
        env_vars: names of variables of this process that the job gets too. Without them it
            gets only the S3 variables its run directory or data needs (names logged, never
            values).
    """
    command = list(command)
    if not command or command[0] not in SUBMITTABLE:
        raise BadInputError(
            f"submit runs one of {', '.join(SUBMITTABLE)}, e.g. "
            f"'raytrain submit -- train --config my.yaml'; got {shlex.join(command) or 'nothing'}"
        )
    root = Path(working_dir).expanduser().resolve()
    if not root.is_dir():
        raise BadInputError(
            f"--working-dir '{working_dir}' is not a directory; pass the directory to send "
            f"with the job (default: the current one)"
        )
    command, parsed = _job_command(command, root)
    variables = _job_variables(parsed, env_vars)
    client = _client(address)
    job_id = client.submit_job(
        entrypoint=shlex.join(["raytrain", *command]),
        runtime_env={"working_dir": str(root), "excludes": _EXCLUDES, "env_vars": variables},
        metadata={"submitted_by": "raytrain"},
    )
    if wait:
        follow_logs(job_id, address=address, write=write)
    return job_id


def follow_logs(
    job_id: str, *, address: str | None = None, write: Callable[[str], Any] | None = None
) -> str:
    """Stream a job's logs until it ends; return its final status.

    The stream runs in a daemon thread while this thread waits, so Ctrl-C reaches the caller
    at once as KeyboardInterrupt. Streamed in this thread, Ctrl-C would only cancel the
    stream's asyncio task, and a cancellation swallowed inside the websocket client (seen
    under load) left ``raytrain submit`` streaming on after Ctrl-C.
    """
    client = _client(address)
    failed: list[BaseException] = []

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            (write or sys.stdout.write)(chunk)  # stdout as it is now, not at import

    def stream() -> None:
        try:
            asyncio.run(tail())
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)

    streaming = threading.Thread(target=stream, name="raytrain-job-logs", daemon=True)
    streaming.start()
    while streaming.is_alive():
        streaming.join(timeout=0.5)
    if failed:
        raise failed[0]
    return job_status(job_id, address=address)


def job_status(job_id: str, *, address: str | None = None) -> str:
    """The job's status: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    return str(_job_call(address, job_id, "get_job_status").value)


def job_logs(job_id: str, *, address: str | None = None) -> str:
    """Everything the job has logged so far."""
    return _job_call(address, job_id, "get_job_logs")


def stop_job(job_id: str, *, address: str | None = None) -> bool:
    """Ask the cluster to stop the job; False if it had already ended."""
    return bool(_job_call(address, job_id, "stop_job"))


def list_jobs(*, address: str | None = None) -> list[Any]:
    """All jobs the cluster knows, oldest first (``JobDetails`` objects)."""
    jobs = _client(address).list_jobs()
    return sorted(jobs, key=lambda job: job.start_time or 0)
