"""The ``raytrain`` command line: its commands, their flags, and their one-line errors.

``cli.py`` says what each command does; this module only what it accepts. ``raytrain
submit`` parses the command it sends with the same parser (``parse_submitted_command``),
so a job is refused here as ``raytrain`` would refuse it on the cluster.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from raytrain_app.errors import BadInputError


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: no usage block, a pointer to --help instead."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see '{self.prog} --help'\n")


class _SubmittedCommandParser(_Parser):
    """The parser of the command ``raytrain submit`` sends: what it refuses raises, so the
    job is refused before it is sent, and it prints nothing (no help or version text)."""

    def error(self, message: str) -> NoReturn:
        raise BadInputError(
            f"{message} in the command after 'raytrain submit --'; see '{self.prog} --help'"
        )

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise BadInputError(
            f"--help and --version are not for a job; run '{self.prog} --help' here, then "
            f"submit the command itself"
        )

    def _print_message(self, message: str, file: object = None) -> None:
        pass


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", "-c", metavar="PATH", help="YAML config (default: the built-in quickstart)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.lr=3e-4 (repeatable)",
    )
    parser.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray cluster to use (default: RAY_ADDRESS, else start Ray here)",
    )


def _add_submit_flags(submit: argparse.ArgumentParser) -> None:
    submit.add_argument(
        "--address",
        metavar="URL",
        help="job server, e.g. http://HEAD:8265 (default: "
        "RAY_API_SERVER_ADDRESS, then RAY_ADDRESS)",
    )
    submit.add_argument(
        "--no-wait",
        action="store_true",
        help="print the job id and return instead of streaming its logs",
    )
    submit.add_argument(
        "--working-dir",
        default=".",
        metavar="D",
        help="directory sent with the job, its working directory (default: the current one)",
    )
    submit.add_argument(
        "--env-var",
        dest="env_vars",
        action="append",
        default=[],
        metavar="NAME",
        help="give the job this shell's variable NAME (repeatable); nothing else of this "
        "shell goes along but the AWS credential, region and endpoint variables, when the "
        "run directory or data.path is in S3",
    )
    submit.add_argument(
        "raytrain_args",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="the raytrain command to run, after --",
    )


def _add_jobs_actions(jobs: argparse.ArgumentParser) -> None:
    jobs.add_argument("--address", metavar="URL", help="job server (as for submit)")
    actions = jobs.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="every job on the cluster")
    for name, text in (
        ("status", "a job's status"),
        ("logs", "a job's logs"),
        ("stop", "stop a job"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("job_id")
        if name == "logs":
            action.add_argument(
                "--follow", "-f", action="store_true", help="keep streaming until the job ends"
            )


def _add_predict_flags(predict: argparse.ArgumentParser) -> None:
    predict.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="checkpoint directory, or run directory (its best checkpoint by train.monitor)",
    )
    predict.add_argument(
        "--input",
        metavar="PARQUET",
        help="Parquet file with the training data's columns "
        "(default: the training data's validation split)",
    )
    predict.add_argument(
        "--output",
        default="predictions.parquet",
        metavar="PARQUET",
        help="where to write predictions (default: %(default)s)",
    )
    predict.add_argument(
        "--config",
        "-c",
        metavar="PATH",
        help="your config: the model and data factories it names may be called",
    )
    _add_trust_flag(
        predict,
        "call the model and data factories the checkpoint names even if they are not built "
        "in: only for run directories whose writers you trust (a checkpoint is data)",
    )


def _add_export_flags(export: argparse.ArgumentParser) -> None:
    export.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="checkpoint directory, or run directory (its best checkpoint by train.monitor)",
    )
    export.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="a new folder for config.json and model.safetensors (from_pretrained reads it)",
    )
    export.add_argument(
        "--config",
        "-c",
        metavar="PATH",
        help="your config: the model factory it names may be called",
    )
    _add_trust_flag(
        export,
        "call the model factory the checkpoint names even if it is not built in: only for "
        "run directories whose writers you trust (a checkpoint is data)",
    )


def _add_trust_flag(parser: argparse.ArgumentParser, text: str) -> None:
    """``--trust-code``: every command that loads what a run directory holds takes it."""
    parser.add_argument("--trust-code", action="store_true", help=text)


def _versions() -> str:
    """From the installed packages' metadata: importing Ray and torch would take seconds."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (
        f"raytrain {installed('raytrain_app')}, ray {installed('ray')}, "
        f"torch {installed('torch')}, python {sys.version.split()[0]}"
    )


class _VersionAction(argparse.Action):
    """argparse's version action, with the versions looked up only when asked for (reading
    the packages' metadata costs some 40 ms that every other command would pay)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        sys.stdout.write(_versions() + "\n")
        parser.exit()


def build_parser(parser_class: type[_Parser] = _Parser) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="raytrain", description="Data-parallel PyTorch training on Ray, laptop to SLURM."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="raytrain's, Ray's, torch's and Python's versions (for bug reports)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train a model (default: the quickstart)")
    _add_config_flags(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--local",
        action="store_true",
        help="run in this process, without a Ray cluster (Ray Train's local mode): fast to "
        "start, and breakpoint()/pdb work in your model's step",
    )
    train.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="with --local: N processes on this machine under torchrun",
    )

    plan = commands.add_parser("plan", help="print the resolved plan; start nothing")
    _add_config_flags(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object")

    tune = commands.add_parser("tune", help="hyperparameter sweep of single-worker trials")
    _add_config_flags(tune)
    _add_trust_flag(
        tune,
        "resume a sweep whose saved Tune state (which Tune unpickles) is in a bucket or not "
        "provably yours: only if you trust everyone who can write there",
    )

    submit = commands.add_parser(
        "submit",
        help="run train or tune as a Ray job on a cluster",
        usage="raytrain submit [--address URL] [--no-wait] [--working-dir D] "
        "[--env-var NAME ...] -- train|tune [ARGS ...]",
    )
    _add_submit_flags(submit)
    _add_jobs_actions(commands.add_parser("jobs", help="manage submitted jobs"))
    _add_predict_flags(
        commands.add_parser("predict", help="single-device inference from a checkpoint")
    )
    _add_export_flags(
        commands.add_parser(
            "export", help="write a checkpoint's Hugging Face model as save_pretrained does"
        )
    )
    return parser


def parse_submitted_command(command: Sequence[str]) -> argparse.Namespace:
    """Parse the raytrain command ``raytrain submit`` sends as ``raytrain`` will on the
    cluster; what it would refuse raises BadInputError."""
    args, unknown = build_parser(_SubmittedCommandParser).parse_known_args(list(command))
    if unknown:  # named here with the command's own --help, not raytrain's
        raise BadInputError(
            f"unrecognized arguments: {' '.join(unknown)} in the command after 'raytrain "
            f"submit --'; see 'raytrain {args.command} --help'"
        )
    return args
