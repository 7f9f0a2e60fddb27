"""Bad input across the CLI, config and data: one table, each case run as the real console script.

Every case must exit 2 with exactly one stderr line that names the key, file or flag and says
how to fix it, print no traceback, leave no Ray running and leave the workspace byte for byte as it
was, above all the finished run ``runs/existing`` that many cases aim at.

Speed: a fresh ``python -m raytrain_app.cli`` pays ~3 s of torch and Ray imports, ~4 minutes of
CPU for this table. So one runner process (``forking_cli.ForkingCli``) imports the CLI once and
forks a child per case; the child runs ``sys.exit(cli.main())`` with its own stdout, stderr and
exit status, exactly as the ``raytrain`` entry point does. ``ray.init`` is replaced in the
runner (``refuse_ray_init``), so a case that slips through to Ray fails with a traceback instead
of starting a cluster. (``raytrain train`` begins an embedded Ray's start beside its checks; a
refusal stops it: tests/unit/driver/test_ray_beside.py. Here that start fails at once, and only
a case that goes on to use Ray sees the failure.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from forking_cli import ForkingCli
from torch import nn

from raytrain_app.checkpoint.store import MODEL_FILE, save_checkpoint
from raytrain_app.config import config_to_dict, load_config, save_config
from raytrain_app.data import parquet_windows, synthetic_wind
from raytrain_app.testing.isolation import isolated_env
from raytrain_app.testing.ports import free_ports
from raytrain_app.workloads import BUILTIN_MODELS, FactoryRef, build_model

EXISTING = "existing"  # experiment.name of the finished run every case must leave untouched
RUN_DIR = f"runs/{EXISTING}"
CKPT_DIR = f"{RUN_DIR}/checkpoints/{EXISTING}/checkpoint_epoch0002_step000000020"
CASE_TIMEOUT_S = 60
RUNNING_AS_ROOT = os.geteuid() == 0

# A Parquet-backed config aimed at the existing run; cases swap in a bad data.path with --set.
PARQUET_CONFIG = f"""\
experiment: {{name: {EXISTING}}}
data:
  path: data/turbines.parquet
  params:
    feature_columns: [{", ".join(synthetic_wind.FEATURE_COLUMNS)}]
    target_column: {synthetic_wind.TARGET_COLUMN}
    group_column: {synthetic_wind.GROUP_COLUMN}
    time_column: {synthetic_wind.TIME_COLUMN}
scaling: {{num_workers: 1, use_gpu: false}}
"""


@dataclass(frozen=True)
class Case:
    """One bad input: the raytrain arguments and what its one-line error must contain.

    ``{port}`` in ``argv`` and ``expect`` becomes a local port nothing listens on. ``files``
    (path relative to the workspace -> text) are written before the case runs. ``hidden``
    (a secret in ``argv``) must not appear in the output; ``timeout_s`` is shorter for the
    cases that once hung.
    """

    id: str
    argv: tuple[str, ...]
    expect: tuple[str, ...]  # the key, file or flag, then a piece of the fix
    files: Mapping[str, str] = field(default_factory=dict)
    code: int = 2
    hidden: tuple[str, ...] = ()
    timeout_s: float = CASE_TIMEOUT_S


def on_existing(command: str, *sets: str) -> tuple[str, ...]:
    """``raytrain <command>`` of the existing run's experiment with ``--set`` overrides."""
    argv = [command, "--set", f"experiment.name={EXISTING}"]
    for item in sets:
        argv += ["--set", item]
    return tuple(argv)


def on_cpu(*sets: str) -> tuple[str, ...]:
    """``train`` of the existing experiment on CPU workers, whatever this machine has."""
    return on_existing("train", "scaling.use_gpu=false", "scaling.cpus_per_worker=0.25", *sets)


def parquet(*sets: str, command: str = "train") -> tuple[str, ...]:
    argv = [command, "--config", "parquet.yaml"]
    for item in sets:
        argv += ["--set", item]
    return tuple(argv)


def config_file(
    name: str, text: str, expect: tuple[str, ...], command: str = "train", **more
) -> Case:
    path = f"cases/{name}.yaml"
    return Case(name, (command, "--config", path), (path, *expect), {path: text}, **more)


# Nine lines of aliases of aliases: 10**10 values in 647 bytes, loaded as shared references
# before and built by the first copy or dump of the config.
ALIAS_BOMB = (
    "model:\n  params:\n    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + ("".join(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)))
)
# An AWS-style secret with a '/', which ends a URI's host part early.
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY"
HOSTILE_TIMEOUT_S = 20
STEP_LR, ONE_CYCLE = "torch.optim.lr_scheduler:StepLR", "torch.optim.lr_scheduler:OneCycleLR"


UNREADABLE_DATA = (
    # root reads any file whatever its mode: a directory where the file belongs instead
    Case(
        "data_path_is_an_empty_directory",
        parquet("data.path=data/folder.parquet"),
        ("data/folder.parquet", "give a file, a directory or a glob"),
    )
    if RUNNING_AS_ROOT
    else Case(
        "unreadable_data_path",
        parquet("data.path=data/locked.parquet"),
        ("data/locked.parquet", "permission denied", "make it readable"),
    )
)

CASES = [
    # ------------------------------------------------------------------ config files
    config_file("yaml_tab", "train:\n\tepochs: 3\n", ("line 2", "indent with spaces, not tabs")),
    config_file(
        "yaml_unclosed_bracket", "train: {epochs: 3\n", ("not valid YAML", "fix the YAML syntax")
    ),
    config_file(
        "yaml_duplicate_key",
        "train:\n  epochs: 1\n  epochs: 2\n",
        ("duplicate key 'epochs'", "fix the YAML syntax"),
    ),
    config_file("empty_config_file", "", ("is empty", "leave out --config")),
    config_file("comment_only_config_file", "# nothing yet\n", ("is empty", "config section")),
    config_file(
        "config_is_a_list", "- train\n- model\n", ("a list", "must contain a mapping of config")
    ),
    config_file(
        "unknown_section",
        f"experiment: {{name: {EXISTING}}}\ntrian:\n  epochs: 1\n",
        ("'trian'", "did you mean 'train'"),
    ),
    config_file(
        "unknown_key_in_section",
        f"experiment: {{name: {EXISTING}}}\ntrain:\n  epoch: 3\n",
        ("'train.epoch'", "did you mean 'train.epochs'"),
    ),
    config_file(
        "key_in_the_wrong_section",
        f"experiment: {{name: {EXISTING}}}\nlr: 0.1\n",
        ("'lr'", "did you mean 'train.lr'"),
    ),
    config_file(
        "yaml_alias_bomb",
        ALIAS_BOMB,
        ("too large to load", "expands to more than 100000 values", "nest fewer &anchors"),
        timeout_s=HOSTILE_TIMEOUT_S,
    ),
    config_file(
        "yaml_recursive_alias",
        "model:\n  params: &p {again: *p}\n",
        ("too large to load", "remove that alias"),
    ),
    config_file(
        "data_path_and_target_together",
        f"experiment: {{name: {EXISTING}}}\n"
        "data:\n  path: data/turbines.parquet\n  target: my_pkg.data:build\n",
        ("'data'", "keep exactly one of name, path, target"),
    ),
    Case(
        "missing_config_file",
        ("train", "--config", "cases/nope.yaml"),
        ("cases/nope.yaml", "pass an existing YAML file with --config"),
    ),
    Case(
        "config_is_a_directory",
        ("train", "--config", "runs"),
        ("'runs'", "is a directory", "pass a YAML file"),
    ),
    # ------------------------------------------------------------------ --set
    Case(
        "set_without_equals",
        on_existing("train", "train.lr"),
        ("--set train.lr", "expected KEY=VALUE"),
    ),
    Case(
        "set_unknown_key",
        on_existing("train", "scaling.num_worker=2"),
        ("'scaling.num_worker'", "did you mean 'scaling.num_workers'"),
    ),
    Case(
        "set_bad_yaml_value",
        on_existing("train", "train.lr=[1e-3"),
        ("'train.lr'", "must be a number > 0"),
    ),
    Case(
        "set_inside_a_single_value",
        on_existing("train", "train.lr.max=1"),
        ("'train.lr' is a single value", "--set train.lr=VALUE"),
    ),
    Case(
        "set_empty_key_part",
        on_existing("train", "train..lr=1"),
        ("--set train..lr=1", "dotted key like train.lr"),
    ),
    # ------------------------------------------------------------------ wrong types
    Case(
        "string_for_int",
        on_existing("train", "train.epochs=five"),
        ("'train.epochs'", "must be an integer >= 1"),
    ),
    Case(
        "bool_for_int",
        on_existing("train", "train.global_batch_size=true"),
        ("'train.global_batch_size'", "must be an integer >= 1"),
    ),
    Case(
        "float_for_int",
        on_existing("train", "train.epochs=2.5"),
        ("'train.epochs'", "must be an integer >= 1"),
    ),
    Case(
        "list_for_float",
        on_existing("train", "train.lr=[0.1, 0.2]"),
        ("'train.lr'", "must be a number > 0"),
    ),
    Case(
        "value_for_a_section",
        on_existing("train", "scaling=4"),
        ("'scaling'", "must be a mapping with keys num_workers"),
    ),
    Case(
        "unknown_precision",
        on_existing("train", "precision=fp8"),
        ("'precision'", "allowed: auto, fp32, bf16, fp16"),
    ),
    Case(
        "unsafe_experiment_name",
        ("train", "--set", f"experiment.name=../{EXISTING}"),
        ("'experiment.name'", "must be letters, digits"),
    ),
    # ------------------------------------------------------------------ zero and negative sizes
    *(
        Case(f"{name}", on_existing("train", f"{key}={value}"), (f"'{key}'", allowed))
        for name, key, value, allowed in [
            ("zero_epochs", "train.epochs", 0, "must be an integer >= 1"),
            ("negative_global_batch", "train.global_batch_size", -64, "must be an integer >= 1"),
            ("zero_max_batch_per_worker", "train.max_batch_per_worker", 0, "integer >= 1"),
            ("zero_lr", "train.lr", 0, "must be a number > 0"),
            ("negative_lr", "train.lr", -0.001, "must be a number > 0"),
            ("negative_warmup", "train.warmup_steps", -1, "must be an integer >= 0"),
            ("zero_num_workers", "scaling.num_workers", 0, "integer >= 1"),
            ("zero_cpus_per_worker", "scaling.cpus_per_worker", 0, "must be a number > 0"),
            ("zero_timeout", "distributed.timeout_s", 0, "must be an integer >= 1"),
            ("zero_prefetch_factor", "dataloader.prefetch_factor", 0, "must be an integer >= 1"),
            ("negative_loader_workers", "dataloader.num_workers", -1, "integer >= 0"),
        ]
    ),
    Case(
        "infinite_lr",
        on_existing("train", "train.lr=.inf"),
        ("'train.lr'", "must be a finite number > 0"),
    ),
    Case(
        "nan_weight_decay",
        on_existing("train", "train.weight_decay=.nan"),
        ("'train.weight_decay'", "must be a finite number >= 0"),
    ),
    Case(
        "plan_global_batch_of_1e21",  # the micro-batch search was linear in it: plan hung
        ("plan", "--set", "train.global_batch_size=1000000000000000000000"),
        ("'train.global_batch_size'", "must be an integer >= 1 and <= 1000000000"),
        timeout_s=HOSTILE_TIMEOUT_S,
    ),
    Case(
        "elastic_range_too_wide_for_any_batch",  # a 43 000-digit lcm: a traceback
        on_cpu("scaling.num_workers=[1, 100000]"),
        ("scaling.num_workers=[1, 100000]", "narrow it to scaling.num_workers=[1, 2]"),
        timeout_s=HOSTILE_TIMEOUT_S,
    ),
    Case(
        "zero_tune_samples",
        ("tune", "--set", "tune.num_samples=0"),
        ("'tune.num_samples'", "must be an integer >= 1"),
    ),
    # ------------------------------------------------------------------ plan: batch, device
    Case(
        "batch_not_divisible_by_workers",
        on_cpu("scaling.num_workers=2", "train.global_batch_size=65"),
        ("train.global_batch_size=65", "multiple of 2 (e.g. 64 or 66)"),
    ),
    # ------------------------------------------------------------------ recipe, tried on the driver
    Case(
        "scheduler_without_its_step_size",
        on_cpu(f"train.schedule.target={STEP_LR}"),
        ("train.schedule: StepLR()", "'step_size'", "fix train.schedule.params"),
    ),
    Case(
        "scheduler_step_size_zero",  # torch builds it; its first step divides by zero
        on_cpu(f"train.schedule.target={STEP_LR}", "train.schedule.params.step_size=0"),
        ("train.schedule: StepLR(step_size=0)", "ZeroDivisionError", "fix train.schedule.params"),
    ),
    Case(
        "onecycle_without_total_steps",
        on_cpu(f"train.schedule.target={ONE_CYCLE}", "train.schedule.params.max_lr=0.01"),
        ("train.schedule: OneCycleLR(max_lr=0.01)", "total_steps", "fix train.schedule.params"),
    ),
    Case(
        "optimizer_fused_beside_foreach",
        on_cpu("train.optimizer={target: 'torch.optim:AdamW', params: {fused: 1, foreach: 1}}"),
        ("train.optimizer: AdamW(fused=1, foreach=1)", "fix train.optimizer.params"),
    ),
    Case(
        "batch_split_under_a_micro_batch_cap",
        on_cpu(
            "scaling.num_workers=2", "train.global_batch_size=3", "train.max_batch_per_worker=1"
        ),
        ("train.global_batch_size=3", "multiple of 2"),
    ),
    Case(
        "more_workers_than_the_machine",
        on_cpu("scaling.num_workers=4096"),
        ("scaling.num_workers=4096", "lower scaling.num_workers"),
    ),
    Case(
        "fp16_on_cpu",
        on_cpu("scaling.num_workers=1", "precision=fp16"),
        ("precision=fp16", "set precision to auto, fp32 or bf16"),
    ),
    Case(
        "gpu_without_a_gpu",  # the runner hides every GPU
        on_existing("train", "scaling.use_gpu=true"),
        ("scaling.use_gpu=true", "set scaling.use_gpu=auto or false"),
    ),
    Case(
        "nccl_on_cpu",
        on_cpu("scaling.num_workers=1", "distributed.backend=nccl"),
        ("distributed.backend=nccl", "set distributed.backend to auto or gloo"),
    ),
    Case(
        "fsdp_with_grad_compression",
        on_cpu(
            "scaling.num_workers=2",
            "distributed.strategy=fsdp",
            "distributed.grad_compression=powersgd",
        ),
        ("distributed.grad_compression=powersgd", "set distributed.grad_compression=none"),
    ),
    Case(
        "single_strategy_with_two_workers",
        on_cpu("scaling.num_workers=2", "distributed.strategy=single"),
        ("scaling.num_workers=2", "set scaling.num_workers=1"),
    ),
    Case(
        "existing_run_with_another_config",
        on_cpu("scaling.num_workers=1", "train.epochs=9"),
        (f"experiment.name '{EXISTING}' already holds a run", "set a new experiment.name"),
    ),
    # ------------------------------------------------------------------ data
    Case(
        "missing_data_path",
        parquet("data.path=data/missing.parquet"),
        ("data/missing.parquet", "give a file, a directory or a glob"),
    ),
    UNREADABLE_DATA,
    Case(
        "parquet_missing_column",
        parquet("data.path=data/no_power.parquet"),
        ("['power'] not found", "data/no_power.parquet", "fix the column names in data.params"),
    ),
    Case(
        "parquet_wrong_typed_column",
        parquet("data.path=data/text_speed.parquet"),
        ("'wind_speed'", "data/text_speed.parquet", "must be numeric"),
    ),
    Case(
        "truncated_parquet",
        parquet("data.path=data/truncated.parquet"),
        ("data/truncated.parquet", "not a readable Parquet file", "write it again as Parquet"),
    ),
    Case(
        "csv_named_parquet",
        parquet("data.path=data/csv.parquet"),
        ("data/csv.parquet", "not a readable Parquet file", "write it again as Parquet"),
    ),
    Case(  # the in-process streaming prepare concatenated them: a raw ArrowInvalid
        "type_drift_train_local_streaming",
        (
            *parquet("data.path=data/drift", "data.streaming=true", "experiment.name=drift"),
            "--local",
        ),
        ("'wind_speed' is double in data file 'data/drift/b.parquet'", "same type"),
    ),
    Case(
        "type_drift_predict_input",
        ("predict", "--checkpoint", RUN_DIR, "--input", "data/drift"),
        ("'wind_speed' is double in data file 'data/drift/b.parquet'", "same type"),
    ),
    Case(
        "parquet_without_feature_columns",
        on_existing("train", "data.path=data/turbines.parquet"),
        ("data.params.feature_columns", "set it to a list of the numeric input columns"),
    ),
    Case(
        "unknown_data_param",
        parquet("data.params.windw=3"),
        ("'data.params.windw'", "allowed keys are"),
    ),
    Case(
        "zero_context_length",
        parquet("data.params.context_length=0"),
        ("data.params.context_length", "must be an integer >= 1"),
    ),
    Case(
        "tune_missing_data_path",
        parquet("data.path=data/missing.parquet", command="tune"),
        ("data/missing.parquet", "give a file, a directory or a glob"),
    ),
    Case(
        "output_dir_with_credentials",
        on_existing("train", f"experiment.output_dir=s3://AKIAEXAMPLE:{SECRET}@bucket/runs"),
        ("'experiment.output_dir': 's3://***@bucket/runs'", "AWS_ACCESS_KEY_ID"),
        hidden=("AKIAEXAMPLE", SECRET.split("/")[0], SECRET.split("/")[1]),
        timeout_s=HOSTILE_TIMEOUT_S,
    ),
    Case(
        "data_path_with_credentials",
        parquet(f"data.path=s3://AKIAEXAMPLE:{SECRET}@bucket/turbines.parquet"),
        ("'data.path': 's3://***@bucket/turbines.parquet'", "AWS_ACCESS_KEY_ID"),
        hidden=("AKIAEXAMPLE", SECRET.split("/")[0], SECRET.split("/")[1]),
        timeout_s=HOSTILE_TIMEOUT_S,
    ),
    Case(
        "predict_checkpoint_with_credentials",
        ("predict", "--checkpoint", f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs/existing"),
        ("--checkpoint='s3://***@bucket/runs/existing'", "AWS_ACCESS_KEY_ID"),
        hidden=("AKIAEXAMPLE", SECRET.split("/")[0], SECRET.split("/")[1]),
        timeout_s=HOSTILE_TIMEOUT_S,
    ),
    # ------------------------------------------------------------------ model and data targets
    Case(
        "unknown_model_name",
        on_existing("train", "model.name=resnet"),
        ("model.name='resnet'", "use one of resnet_small, wind_transformer"),
    ),
    Case(
        "unimportable_model_target",
        on_existing("train", "model.target=no_such_pkg.models:build"),
        ("model.target='no_such_pkg.models:build'", "add its directory to PYTHONPATH"),
    ),
    Case(
        "model_target_missing_attribute",
        on_existing("train", "model.target=raytrain_app.models.wind_transformer:no_such_factory"),
        ("no attribute 'no_such_factory'", "fix model.target"),
    ),
    Case(
        "malformed_model_target",
        on_existing("train", "model.target=my_model.py"),
        ("'model.target'", "must look like 'package.module:attribute'"),
    ),
    Case(
        "unimportable_data_target",
        on_existing("train", "data.target=no_such_pkg.data:build"),
        ("data.target='no_such_pkg.data:build'", "add its directory to PYTHONPATH"),
    ),
    # ------------------------------------------------------------------ predict and checkpoints
    Case(
        "predict_missing_checkpoint",
        ("predict", "--checkpoint", "runs/missing"),
        ("--checkpoint 'runs/missing'", "pass the path printed at the end of 'raytrain train'"),
    ),
    Case(
        "predict_run_without_checkpoints",
        ("predict", "--checkpoint", "runs/fresh"),
        ("--checkpoint 'runs/fresh'", "pass the path printed at the end of 'raytrain train'"),
    ),
    Case(
        "predict_truncated_checkpoint",
        ("predict", "--checkpoint", "ckpts/truncated"),
        ("ckpts/truncated", MODEL_FILE, "damaged", "use an older checkpoint"),
    ),
    Case(
        "predict_checkpoint_of_another_model",
        ("predict", "--checkpoint", "ckpts/other_model"),
        ("ckpts/other_model", MODEL_FILE, "does not fit", "pass a checkpoint directory"),
    ),
    Case(
        "predict_missing_input",
        ("predict", "--checkpoint", RUN_DIR, "--input", "data/missing.parquet"),
        ("--input 'data/missing.parquet'", "pass a Parquet file"),
    ),
    Case(
        "predict_input_not_parquet",
        ("predict", "--checkpoint", RUN_DIR, "--input", "data/csv.parquet"),
        ("data/csv.parquet", "not a readable Parquet file"),
    ),
    Case(
        "predict_output_over_input",
        (
            "predict",
            "--checkpoint",
            RUN_DIR,
            "--input",
            "data/turbines.parquet",
            "--output",
            "data/turbines.parquet",
        ),
        (
            "--output 'data/turbines.parquet' is the --input file",
            "write the predictions to another",
        ),
    ),
    Case(
        "predict_without_checkpoint",
        ("predict",),
        ("required: --checkpoint", "see 'raytrain predict --help'"),
    ),
    # ------------------------------------------------------------------ command line
    Case("unknown_command", ("trian",), ("invalid choice: 'trian'", "see 'raytrain --help'")),
    Case(
        "unknown_flag",
        ("train", "--epochs", "3"),
        ("unrecognized arguments: --epochs 3", "--help"),
    ),
    # ------------------------------------------------------------------ clusters and jobs
    Case(
        "train_unreachable_address",
        ("train", "--set", f"experiment.name={EXISTING}", "--address", "127.0.0.1:{port}"),
        ("--address 127.0.0.1:{port}", "nothing is listening", "start the cluster"),
    ),
    Case(
        "plan_unreachable_ray_client",
        ("plan", "--address", "ray://127.0.0.1:{port}"),
        ("--address ray://127.0.0.1:{port}", "nothing is listening", "start the cluster"),
    ),
    Case(
        "malformed_address",
        ("train", "--address", "tcp://head:6379"),
        ("--address 'tcp://head:6379'", "pass HOST:PORT"),
    ),
    Case(
        "submit_unreachable_address",
        (
            "submit",
            "--address",
            "http://127.0.0.1:{port}",
            "--",
            "train",
            "--config",
            "parquet.yaml",
        ),
        ("--address http://127.0.0.1:{port}", "nothing is listening", "dashboard address"),
    ),
    Case(
        "jobs_unreachable_address",
        ("jobs", "--address", "http://127.0.0.1:{port}", "list"),
        ("--address http://127.0.0.1:{port}", "nothing is listening", "dashboard address"),
    ),
    Case("jobs_without_address", ("jobs", "list"), ("no Ray cluster", "pass --address")),
    Case(
        "submit_without_command",
        ("submit", "--address", "http://127.0.0.1:{port}"),
        ("got nothing", "submit runs one of train, tune"),
    ),
    Case(
        "submit_predict",
        ("submit", "--address", "http://127.0.0.1:{port}", "--", "predict"),
        ("got predict", "submit runs one of train, tune"),
    ),
    Case(
        "submit_config_outside_working_dir",
        (
            "submit",
            "--address",
            "http://127.0.0.1:{port}",
            "--",
            "train",
            "--config",
            "../outside.yaml",
        ),
        ("--config '../outside.yaml' is outside the working directory", "pass --working-dir"),
    ),
    Case(
        "submit_config_equals_outside_working_dir",
        (
            "submit",
            "--address",
            "http://127.0.0.1:{port}",
            "--",
            "train",
            "--config=../outside.yaml",
        ),
        ("--config '../outside.yaml' is outside the working directory", "pass --working-dir"),
    ),
    Case(
        "submit_env_var_unset",
        (
            "submit",
            "--address",
            "http://127.0.0.1:{port}",
            "--env-var",
            "RAYTRAIN_TEST_NEVER_SET",
            "--",
            "train",
        ),
        ("--env-var RAYTRAIN_TEST_NEVER_SET is not set", "export RAYTRAIN_TEST_NEVER_SET first"),
    ),
    Case(
        "submit_missing_working_dir",
        (
            "submit",
            "--address",
            "http://127.0.0.1:{port}",
            "--working-dir",
            "nope",
            "--",
            "train",
        ),
        ("--working-dir 'nope'", "pass the directory to send"),
    ),
]


def test_the_table_is_big_and_every_case_names_the_problem_and_the_fix():
    assert len(CASES) >= 40
    assert len({case.id for case in CASES}) == len(CASES)
    assert all(len(case.expect) >= 2 for case in CASES)


# --------------------------------------------------------------------------- the workspace


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with its content hash."""
    state = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_dir():
            state[f"{name}/"] = "folder"
            continue
        try:
            state[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        except PermissionError:  # the unreadable data file
            stat = path.stat()
            state[name] = f"unreadable, {stat.st_size} bytes, mtime {stat.st_mtime_ns}"
    return state


def _write_data(data: Path) -> tuple[Path, dict]:
    """The good Parquet file and its broken variants; returns the good one and its data info."""
    data.mkdir(parents=True)
    table = synthetic_wind.generate(num_turbines=2, num_hours=300, seed=0)
    good = data / "turbines.parquet"
    pq.write_table(table, good)
    pq.write_table(table.drop_columns([synthetic_wind.TARGET_COLUMN]), data / "no_power.parquet")
    speed = table.schema.get_field_index("wind_speed")
    text = table.set_column(speed, "wind_speed", pc.cast(table["wind_speed"], pa.string()))
    pq.write_table(text, data / "text_speed.parquet")
    (data / "drift").mkdir()  # wind_speed is float in a.parquet, double in b.parquet
    pq.write_table(table, data / "drift" / "a.parquet")
    double = table.set_column(speed, "wind_speed", pc.cast(table["wind_speed"], pa.float64()))
    pq.write_table(double, data / "drift" / "b.parquet")
    payload = good.read_bytes()
    (data / "truncated.parquet").write_bytes(payload[: len(payload) // 2])
    (data / "csv.parquet").write_text("turbine_id,wind_speed,power\n0,7.5,0.4\n")
    if RUNNING_AS_ROOT:
        (data / "folder.parquet").mkdir()
    else:
        shutil.copy(good, data / "locked.parquet")
        (data / "locked.parquet").chmod(0)
    columns = {
        "feature_columns": list(synthetic_wind.FEATURE_COLUMNS),
        "target_column": synthetic_wind.TARGET_COLUMN,
        "group_column": synthetic_wind.GROUP_COLUMN,
        "time_column": synthetic_wind.TIME_COLUMN,
    }
    info = dict(parquet_windows.build_windows(good, **columns).info)
    return good, {"columns": columns, "info": info}


def _write_run(ws: Path, data_path: Path, data: dict) -> Path:
    """A finished-looking run (config, metrics, summary, a real checkpoint) and its neighbours."""
    run = ws / RUN_DIR
    cfg = load_config(
        ws / "parquet.yaml", ["scaling.num_workers=1", "dataloader.num_workers=0", "precision=fp32"]
    )
    save_config(cfg, run / "config.yaml")
    (run / "metrics.csv").write_text(
        "epoch,step,train_loss,val_loss,lr,samples_per_s,epoch_time_s\n"
        "0,10,0.91,0.88,0.001,950.0,0.7\n1,20,0.52,0.55,0.0005,990.0,0.7\n"
    )
    model_ref = FactoryRef(BUILTIN_MODELS["wind_transformer"], {})
    data_ref = FactoryRef(
        "raytrain_app.data.parquet_windows:build",
        {"path": str(data_path), **data["columns"]},
        "data.path",
    )
    torch.manual_seed(0)
    model = build_model(model_ref, data["info"]).module
    meta = {
        "model_factory": asdict(model_ref),
        "data_factory": asdict(data_ref),
        "data_info": data["info"],
        "config": config_to_dict(cfg),
        "epoch": 2,
        "step": 20,
    }
    ckpt = save_checkpoint(ws / CKPT_DIR, model=model, train_state={"epoch": 2}, meta=meta)
    summary = {"final_metrics": {"epoch": 1, "val_loss": 0.55}, "checkpoint": str(ckpt)}
    (run / "summary.json").write_text(json.dumps(summary, indent=2))

    # the checkpoint cases: half a model.pt, and another architecture's intact checkpoint
    truncated = shutil.copytree(ckpt, ws / "ckpts" / "truncated")
    weights = (truncated / MODEL_FILE).read_bytes()
    (truncated / MODEL_FILE).write_bytes(weights[: len(weights) // 2])
    other = nn.Sequential(nn.Linear(7, 3), nn.ReLU(), nn.Linear(3, 12))
    save_checkpoint(ws / "ckpts" / "other_model", model=other, train_state={}, meta=meta)

    fresh = ws / "runs" / "fresh"  # a run that never reached its first checkpoint
    (fresh / "checkpoints").mkdir(parents=True)
    fresh_cfg = cfg.model_copy(deep=True)
    fresh_cfg.experiment.name = "fresh"
    save_config(fresh_cfg, fresh / "config.yaml")
    return run


@dataclass
class Workspace:
    root: Path  # the cwd of every case
    io: Path  # where the cases' stdout and stderr go, outside root
    existing_run: dict[str, str]  # hashes of the existing run's files, taken at creation
    port: int


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    base = tmp_path_factory.mktemp("bad_input")
    ws = base / "work"
    (ws / "raytmp").mkdir(parents=True)  # RAY_TMPDIR: a started Ray would leave ray/ in it
    (ws / "cases").mkdir()
    (ws / "parquet.yaml").write_text(PARQUET_CONFIG)
    (base / "outside.yaml").write_text("train: {epochs: 1}\n")
    (base / "io").mkdir()
    good, data = _write_data(ws / "data")
    run = _write_run(ws, good, data)
    return Workspace(ws, base / "io", _snapshot(run), free_ports(1)[0])


@pytest.fixture(scope="module")
def cli(workspace) -> Iterator[ForkingCli]:
    """The runner: every case runs in its cwd ``workspace.root`` and environment."""
    env = isolated_env(
        workspace.io.parent / "home",
        RAY_TMPDIR=str(workspace.root / "raytmp"),
        CUDA_VISIBLE_DEVICES="",  # the device cases assume a CPU-only machine
    )
    runner = ForkingCli(
        cwd=workspace.root,
        env=env,
        io=workspace.io,
        preimport=(
            "raytrain_app.cli",
            "raytrain_app.jobs",
            "raytrain_app.predict",
            "raytrain_app.workloads",
            "raytrain_app.driver.training",
            "raytrain_app.sweep.tuning",
        ),
        refuse_ray_init="bad input got as far as ray.init",
    )
    yield runner
    runner.close()


# --------------------------------------------------------------------------- the test


def _changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [
        f"{'added' if name not in before else 'removed' if name not in after else 'changed'} {name}"
        for name in sorted(before.keys() | after.keys())
        if before.get(name) != after.get(name)
    ]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_exits_2_with_one_line_and_changes_nothing(case, workspace, cli):
    for name, text in case.files.items():
        (workspace.root / name).write_text(text)
    argv = [arg.replace("{port}", str(workspace.port)) for arg in case.argv]
    before = _snapshot(workspace.root)

    done = cli.run(argv, timeout_s=case.timeout_s, name=case.id)
    code, out, err = done.returncode, done.stdout, done.stderr

    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    message = lines[0]
    assert message.startswith("error: "), message
    assert code == case.code, message
    for part in case.expect:
        assert part.replace("{port}", str(workspace.port)) in message
    assert out == ""
    assert not [secret for secret in case.hidden if secret in err]
    # nothing written or removed anywhere: no run directory, no Ray session, no predictions
    assert _changes(before, _snapshot(workspace.root)) == []
    assert _snapshot(workspace.root / RUN_DIR) == workspace.existing_run
