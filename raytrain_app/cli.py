"""The ``raytrain`` console script: parse flags (``cli_flags.py``), call the API, map errors
to exit codes.

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

import raytrain_app
from raytrain_app import run_clock
from raytrain_app.cli_flags import build_parser
from raytrain_app.config import load_config
from raytrain_app.errors import BadInputError, RunFailedError, RunStoppedError
from raytrain_app.logging_setup import setup_logging

logger = logging.getLogger("raytrain_app.cli")


def _cmd_plan(args: argparse.Namespace) -> int:
    # The config first: a bad key fails before Ray and torch are imported (2 s).
    cfg = load_config(args.config, args.overrides)
    from raytrain_app.driver.data_plan import data_plan, data_plan_line
    from raytrain_app.driver.ray_connection import connected_plan
    from raytrain_app.planning.plan_text import format_plan
    from raytrain_app.workloads import resolve_streaming

    cfg = resolve_streaming(cfg)  # streaming data limits the workers auto picks
    env, plan = connected_plan(cfg, args.address)
    data = data_plan(cfg, plan)
    if args.json:
        print(json.dumps({**plan.to_dict(), **({"data": data} if data else {})}, indent=2))
    else:
        print("\n".join([format_plan(env, plan), *data_plan_line(data)]))
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
    # raytrain_app.train: a Ray started for the run starts beside the driver's imports
    result = raytrain_app.train(
        cfg, address=args.address, progress=not args.no_progress, local=args.local
    )
    from raytrain_app.driver.goodput import goodput_line

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
    print(f"time          : {goodput_line(s['goodput'])}")  # where the wall time went
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
    # raytrain_app.tune: a Ray started for the sweep starts beside its imports
    result = raytrain_app.tune(cfg, address=args.address, trust_code=args.trust_code)
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


def _cmd_export(args: argparse.Namespace) -> int:
    from raytrain_app.checkpoint.export import export_hf

    config = load_config(args.config, ()) if args.config else None
    folder = export_hf(args.checkpoint, args.output, trust_code=args.trust_code, config=config)
    print(f"exported to {folder}: load it with from_pretrained('{folder}')")
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
    "export": _cmd_export,
    "submit": _cmd_submit,
    "jobs": _cmd_jobs,
}


def command() -> int:
    """The ``raytrain`` command: a run's start-up counts from raytrain's first import."""
    run_clock.mark_command_start()
    return main()


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
    sys.exit(command())
