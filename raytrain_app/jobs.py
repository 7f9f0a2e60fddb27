"""Ray job submission: run ``raytrain train|tune`` on a running cluster, and manage the jobs.

Everything goes through Ray's ``JobSubmissionClient``: the working directory (with the
config and any user code in it) travels as the job's ``runtime_env`` and the entrypoint
is the same ``raytrain`` command, run on the head node.
"""

from __future__ import annotations

import asyncio
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
    storage_env_vars,
)

TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
SUBMITTABLE = ("train", "tune")
# Never worth uploading: environments, VCS data, earlier runs, caches.
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
]


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


def _relative_config(command: list[str], working_dir: Path) -> list[str]:
    """Rewrite ``--config PATH`` relative to the working dir the job will run in."""
    rewritten = list(command)
    for i, arg in enumerate(rewritten[:-1]):
        if arg in ("--config", "-c"):
            path = Path(rewritten[i + 1]).expanduser().resolve()
            if not path.is_file():
                raise BadInputError(
                    f"--config '{rewritten[i + 1]}' does not exist; pass an existing YAML file "
                    f"inside the working directory sent with the job"
                )
            try:
                rewritten[i + 1] = str(path.relative_to(working_dir))
            except ValueError:
                raise BadInputError(
                    f"--config '{rewritten[i + 1]}' is outside the working directory "
                    f"'{working_dir}' that is sent with the job; move it there or pass "
                    f"--working-dir"
                ) from None
    return rewritten


def submit(
    command: Sequence[str],
    *,
    address: str | None = None,
    working_dir: str = ".",
    wait: bool = True,
    write: Callable[[str], Any] | None = None,
) -> str:
    """Submit ``raytrain <command>`` as a Ray job; return its id.

    Args:
        command: the raytrain arguments, e.g. ``["train", "--set", "train.epochs=3"]``.
        address: the cluster's dashboard address; defaults to RAY_API_SERVER_ADDRESS or
            RAY_ADDRESS.
        working_dir: uploaded with the job and used as its working directory.
        wait: stream the job's logs through ``write`` (default: stdout) until it ends.
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
    command = _relative_config(command, root)
    client = _client(address)
    job_id = client.submit_job(
        entrypoint=shlex.join(["raytrain", *command]),
        runtime_env={
            "working_dir": str(root),
            "excludes": _EXCLUDES,
            # An object-store run directory: the job reaches it with this machine's AWS_*.
            "env_vars": storage_env_vars(),
        },
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
