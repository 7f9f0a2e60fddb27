"""The ``raytrain`` console script: parse flags, call the API, map errors to exit codes.

Exit codes: 0 success, 2 bad input (config, flag, path), 1 the run failed, 130 interrupted,
75 stopped on a preemption signal with a checkpoint (re-run or requeue to resume); Ctrl-C
also checkpoints at the next step before exiting 130, a second Ctrl-C exits at once.
Errors print as one line; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from raytrain_app.config import load_config
from raytrain_app.errors import BadInputError, RunFailedError, RunStoppedError
from raytrain_app.logging_setup import setup_logging

logger = logging.getLogger("raytrain_app.cli")


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
    return parser


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _kept(keep: int | None) -> str:
    return "every checkpoint, best" if keep is None else f"the {keep} best"


def _workers(plan) -> str:
    if plan.worker_range is None:
        return str(plan.world_size)
    low, high = plan.worker_range
    return f"{low} to {high} (elastic)"


def _elastic_lines(plan) -> list[str]:
    """Each size an elastic run may have, with its split (the ends only for long ranges)."""
    if plan.worker_range is None:
        return []
    from raytrain_app.planning.rules import plan_for_world_size

    low, high = plan.worker_range
    sizes = range(low, high + 1) if high - low < 6 else (low, high)
    splits = []
    for size in sizes:
        sized = plan_for_world_size(plan, size)
        splits.append(f"{size} x {sized.per_worker_batch_size} x {sized.grad_accum_steps}")
    return [
        f"elastic     : workers x micro-batch x accumulation = {', '.join(splits)}; global "
        f"batch {plan.effective_batch_size} at every size; a resize restarts from the newest "
        f"checkpoint"
    ]


def _format_plan(env, plan) -> str:
    r = env.resources
    gpu = (
        f", GPU {env.gpu.name} (cc {env.gpu.capability[0]}.{env.gpu.capability[1]})"
        if env.gpu
        else ""
    )
    return "\n".join(
        [
            f"environment : {env.platform}, python {env.python}, torch {env.torch_version}, "
            f"launcher {env.launcher}",
            f"resources   : {r.cpus:g} CPUs, {r.gpus:g} GPUs, {r.nodes} node(s) ({r.source}){gpu}",
            f"workers     : {_workers(plan)} on {plan.device} ({plan.cpus_per_worker:g} CPU"
            + (f", {plan.gpus_per_worker:g} GPU" if plan.use_gpu else "")
            + " each)"
            + ("" if plan.fits else "; more than can be hosted now (see the warning above)"),
            f"batch       : {plan.per_worker_batch_size} per worker x {plan.world_size} workers x "
            f"{plan.grad_accum_steps} accumulation = {plan.effective_batch_size} effective"
            + (", micro-batch probed on the GPUs at start" if plan.memory_probe else ""),
            *_elastic_lines(plan),
            f"precision   : {plan.precision}"
            + (" + GradScaler" if plan.grad_scaler else "")
            + (", TF32 matmul" if plan.tf32 else ""),
            f"distributed : {plan.strategy} over {plan.backend}, timeout {plan.timeout_s}s, "
            f"SyncBatchNorm {'on' if plan.sync_batchnorm else 'off'}, "
            f"gradient compression {plan.grad_compression}",
            f"speed/memory: torch.compile {_on(plan.compile)}, fused optimizer "
            f"{_on(plan.fused_optimizer)}, gradient checkpointing "
            + (
                "auto (on if the probed micro-batch is too small)"
                if plan.gradient_checkpointing_auto
                else _on(plan.gradient_checkpointing)
            ),
            "weights     : "
            + (
                f"EMA with decay {plan.ema_decay:g} from step {plan.ema_start_step}, "
                "used for validation"
                if plan.ema_decay is not None
                else "no EMA"
            ),
            f"optimizer   : {plan.optimizer}",
            f"lr          : {plan.lr:.4g} (base {plan.base_lr:.4g}, scaling {plan.lr_scaling}), "
            f"{plan.schedule}" + _floor(plan),
            f"stopping    : early stopping on {plan.monitor} ({plan.early_stopping})"
            if plan.early_stopping
            else "stopping    : after train.epochs (no early stopping)",
            f"dataloader  : {plan.dataloader_workers} loader processes per worker, "
            f"pin_memory {plan.pin_memory}",
            f"checkpoints : keep {_kept(plan.keep_checkpoints)} by {plan.monitor} "
            f"({plan.monitor_mode}) and always the newest; a resume continues from the newest",
            "tracking    : metrics.csv (rank 0)" + "".join(f", {name}" for name in plan.tracking),
            *(f"note        : {note}" for note in plan.notes),
        ]
    )


def _floor(plan: Any) -> str:
    """Where cosine and linear decay end."""
    return f" to {plan.min_lr_ratio:g}x" if plan.schedule.endswith(("cosine", "linear")) else ""


def _cmd_plan(args: argparse.Namespace) -> int:
    # The config first: a bad key fails before Ray and torch are imported (2 s).
    cfg = load_config(args.config, args.overrides)
    from raytrain_app.driver.data_plan import data_plan, data_plan_line
    from raytrain_app.driver.ray_connection import connected_plan

    env, plan = connected_plan(cfg, args.address)
    data = data_plan(cfg, plan)
    if args.json:
        print(json.dumps({**plan.to_dict(), **({"data": data} if data else {})}, indent=2))
    else:
        print("\n".join([_format_plan(env, plan), *data_plan_line(data)]))
    return 0


def _train_under_torchrun(args: argparse.Namespace) -> int:
    """``train --local --nproc N``: the same command in N processes under torchrun."""
    from raytrain_app.driver.local_run import run_under_torchrun
    from raytrain_app.planning.environment import detect_environment

    if not args.local:
        raise BadInputError("--nproc runs local processes and needs --local; add --local")
    if args.nproc < 1:
        raise BadInputError(f"--nproc {args.nproc} must be at least 1")
    if detect_environment().torchrun:
        raise BadInputError("already under torchrun: drop --nproc and let torchrun start them")
    argv = ["--debug"] if args.debug else []
    argv += ["train", "--local", *(["--no-progress"] if args.no_progress else [])]
    argv += ["--config", args.config] if args.config else []
    argv += [arg for item in args.overrides for arg in ("--set", item)]
    return run_under_torchrun(argv, args.nproc)


def _cmd_train(args: argparse.Namespace) -> int:
    if args.local and args.address:
        raise BadInputError("--local runs without a Ray cluster; drop --address (or --local)")
    if args.nproc != 1:
        return _train_under_torchrun(args)
    cfg = load_config(args.config, args.overrides)  # before the imports, as in plan
    from raytrain_app.driver.training import train

    result = train(cfg, address=args.address, progress=not args.no_progress, local=args.local)
    if result is None:  # one of torchrun's other processes: rank 0 reports
        return 0
    s = result.summary
    final = s["final_metrics"]
    print(f"run directory : {result.run_dir}")
    # The model's own validation metrics (val_mae, val_accuracy, ...) follow the losses.
    model_metrics = "".join(
        f", {key} {value:.4g}"
        for key, value in final.items()
        if key.startswith("val_") and key != "val_loss" and isinstance(value, int | float)
    )
    print(
        f"final         : epoch {final.get('epoch')}, train_loss {final.get('train_loss', 0):.4f}"
        f", val_loss {final.get('val_loss', 0):.4f}{model_metrics}"
    )
    print(
        f"batch         : effective {s['effective_batch_size']} = {s['world_size']} workers x "
        f"{s['per_worker_batch_size']} x {s['grad_accum_steps']} accumulation; {s['precision']}"
    )
    print(f"throughput    : {s['samples_per_s']:.0f} samples/s; wall time {s['wall_time_s']:.1f} s")
    print(f"checkpoint    : {s['checkpoint']}")
    best = s.get("best_metric")
    if best:
        print(
            f"best          : {s['best_checkpoint']} ({best['metric']} {best['value']:.4f}, "
            f"epoch {best['epoch']})"
        )
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from raytrain_app.config import BUILTIN_SWEEP

    cfg = load_config(args.config, args.overrides, builtin=BUILTIN_SWEEP)  # as in plan
    from raytrain_app.sweep.tuning import tune_sweep

    result = tune_sweep(cfg, address=args.address, trust_code=args.trust_code)
    metric = cfg.tune.metric
    print(result.trials.drop(columns=["error"]).to_string(index=False, float_format="%.4g"))
    failed = result.trials[result.trials["status"] == "error"]
    for _, row in failed.iterrows():
        print(f"trial {row['trial_id']} failed: {row['error']}")
    print(f"best {metric}  : {result.best_metrics.get(metric):.4g}")
    print(f"best config : {result.best_config_path}")
    print(
        f"train it    : raytrain train --config {result.best_config_path} "
        f"--set scaling.num_workers=N"
    )
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from raytrain_app.predict import predict

    config = load_config(args.config, ()) if args.config else None
    output = predict(
        args.checkpoint, args.input, args.output, trust_code=args.trust_code, config=config
    )
    print(f"predictions written to {output}")
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    from raytrain_app import jobs

    command = args.raytrain_args
    command = command[1:] if command[:1] == ["--"] else command
    job_id = jobs.submit(
        command,
        address=args.address,
        working_dir=args.working_dir,
        wait=False,
        env_vars=args.env_vars,
    )
    where = f" --address {args.address}" if args.address else ""
    if args.no_wait:
        print(job_id)
        return 0
    print(f"submitted {job_id}; streaming its logs (Ctrl-C stops watching, not the job)")
    try:
        status = jobs.follow_logs(job_id, address=args.address)
    except KeyboardInterrupt:
        print(
            f"\nstopped watching; {job_id} keeps running. Stop it with: "
            f"raytrain jobs{where} stop {job_id}",
            file=sys.stderr,
        )
        return 130
    print(f"job {job_id} {status}")
    return 0 if status == "SUCCEEDED" else 1


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


def _cmd_jobs(args: argparse.Namespace) -> int:
    from raytrain_app import jobs

    if args.action == "list":
        for job in jobs.list_jobs(address=args.address):
            print(f"{job.submission_id or job.job_id}  {job.status.value:<9}  {job.entrypoint}")
        return 0
    if args.action == "status":
        print(jobs.job_status(args.job_id, address=args.address))
    elif args.action == "logs" and args.follow:
        jobs.follow_logs(args.job_id, address=args.address)
    elif args.action == "logs":
        sys.stdout.write(jobs.job_logs(args.job_id, address=args.address))
    elif args.action == "stop":
        stopped = jobs.stop_job(args.job_id, address=args.address)
        print(f"stopping {args.job_id}" if stopped else f"{args.job_id} had already ended")
    return 0


_COMMANDS = {
    "train": _cmd_train,
    "plan": _cmd_plan,
    "tune": _cmd_tune,
    "predict": _cmd_predict,
    "submit": _cmd_submit,
    "jobs": _cmd_jobs,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(logging.DEBUG if args.debug else logging.INFO)
    try:
        return _COMMANDS[args.command](args)
    except RunStoppedError as exc:  # not a failure: checkpointed, to be resumed or requeued
        print(str(exc), file=sys.stderr)
        return exc.exit_code
    except (BadInputError, RunFailedError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(
            "interrupted; run the same command again to resume from the last checkpoint",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
