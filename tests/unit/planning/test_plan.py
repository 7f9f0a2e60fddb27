"""The plan: batch split, precision, backend, strategy, lr rules — pure functions, no Ray."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from contract import PLAN_JSON_KEYS
from environments import A100, P100, V100, make_env

from raytrain_app.config import config_from_dict
from raytrain_app.planning.batch import PlanError, lr_factor, plan_batch, scaled_lr, steps_per_epoch
from raytrain_app.planning.choices import choose_backend, choose_precision, choose_strategy
from raytrain_app.planning.environment import Environment, SlurmInfo, detect_environment
from raytrain_app.planning.rules import make_plan, resolve_config


@pytest.mark.parametrize("world_size", list(range(1, 65)))
@pytest.mark.parametrize("max_per_worker", [None, 1, 3, 8, 32])
def test_batch_split_is_exact_for_every_world_size(world_size, max_per_worker):
    global_batch = 64 * 3 * 5 * 7  # divisible by many world sizes
    if global_batch % world_size:
        with pytest.raises(PlanError, match="train.global_batch_size"):
            plan_batch(global_batch, world_size, max_per_worker)
        return
    split = plan_batch(global_batch, world_size, max_per_worker)
    assert split.micro_batch * world_size * split.accum_steps == global_batch
    if max_per_worker is not None:
        assert split.micro_batch <= max_per_worker
    else:
        assert split.accum_steps == 1


def test_batch_split_uses_least_accumulation_under_the_cap():
    split = plan_batch(256, 4, 16)
    assert (split.micro_batch, split.accum_steps) == (16, 4)
    split = plan_batch(96, 2, 40)  # 48 per worker: largest divisor <= 40 is 24
    assert (split.micro_batch, split.accum_steps) == (24, 2)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("global_batch", "world_size", "cap", "micro"),
    [
        (2**70, 1, None, 2**70),  # no cap: the whole share, found at once
        (10**21, 2, 10**6, 10**6),  # a small cap that divides the share
        (2 * 999_999_937, 2, 999_999_936, 1),  # a prime share just above the cap
        (10**9, 1, 10**9 - 1, 5 * 10**8),
        (3 * 999_999_937, 3, None, 999_999_937),
    ],
)
def test_the_micro_batch_search_is_fast_for_huge_batches(global_batch, world_size, cap, micro):
    # the search was linear in the batch: a global batch of 1e21 hung `raytrain plan`
    split = plan_batch(global_batch, world_size, cap)
    assert (split.micro_batch, split.global_batch) == (micro, global_batch)


def test_the_micro_batch_search_finds_the_largest_divisor_under_the_cap():
    for share, cap in itertools.product(range(1, 200), range(1, 60)):
        expected = max(d for d in range(1, min(share, cap) + 1) if share % d == 0)
        assert plan_batch(share, 1, cap).micro_batch == expected, (share, cap)


def test_uneven_batch_error_suggests_nearest_valid_sizes():
    with pytest.raises(PlanError) as info:
        plan_batch(100, 3, None)
    message = str(info.value)
    assert "train.global_batch_size=100" in message and "99 or 102" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("requested", "use_gpu", "gpu", "expected"),
    [
        ("auto", False, None, ("fp32", False)),
        ("auto", True, A100, ("bf16", False)),
        ("auto", True, V100, ("fp16", True)),
        ("auto", True, P100, ("fp32", False)),
        ("fp32", True, A100, ("fp32", False)),
        ("fp16", True, A100, ("fp16", True)),
        ("bf16", False, None, ("bf16", False)),
    ],
)
def test_precision_per_capability(requested, use_gpu, gpu, expected):
    assert choose_precision(requested, use_gpu, gpu) == expected


def test_precision_a_device_cannot_do_is_an_error():
    with pytest.raises(PlanError, match="precision=bf16.*8.0.*V100"):
        choose_precision("bf16", True, V100)
    with pytest.raises(PlanError, match="precision=fp16 needs a CUDA GPU"):
        choose_precision("fp16", False, None)


def test_backend_and_strategy():
    assert choose_backend("auto", True) == "nccl"
    assert choose_backend("auto", False) == "gloo"
    with pytest.raises(PlanError, match="distributed.backend=nccl"):
        choose_backend("nccl", False)
    assert choose_strategy("auto") == "ddp"
    assert choose_strategy("fsdp") == "fsdp"  # on GPUs and CPUs alike
    with pytest.raises(PlanError, match="DDP replaces it"):
        choose_strategy("dp")
    # Compression hooks wrap DDP's all-reduce: refused with FSDP, naming both keys.
    with pytest.raises(
        PlanError, match="grad_compression=powersgd .* distributed.strategy=fsdp; set"
    ):
        choose_strategy("fsdp", "powersgd")


@pytest.mark.parametrize(("rule", "expected"), [("none", 1e-3), ("linear", 4e-3), ("sqrt", 2e-3)])
def test_lr_scaling_rules(rule, expected):
    assert scaled_lr(1e-3, rule, 256, 64) == pytest.approx(expected)
    assert scaled_lr(1e-3, rule, 256, None) == pytest.approx(1e-3)  # base defaults to global


def test_lr_schedule_warmup_then_cosine_to_floor():
    factors = [lr_factor(s, 10, 110, 0.1) for s in range(120)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in itertools.pairwise(factors[:10]))
    assert all(a >= b for a, b in itertools.pairwise(factors[10:110]))
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[110] == pytest.approx(0.1) and factors[119] == pytest.approx(0.1)
    assert lr_factor(0, 0, 100, 0.0) == pytest.approx(1.0)


def test_steps_per_epoch_drops_the_tail_and_rejects_tiny_data():
    assert steps_per_epoch(1000, 64) == 15
    with pytest.raises(PlanError, match="fewer than train.global_batch_size=64"):
        steps_per_epoch(10, 64)


def test_auto_plan_on_a_two_core_cpu_machine():
    plan = make_plan(config_from_dict({}), make_env(cpus=2))
    assert (plan.world_size, plan.per_worker_batch_size, plan.grad_accum_steps) == (2, 32, 1)
    assert (plan.precision, plan.backend, plan.strategy, plan.use_gpu) == (
        "fp32",
        "gloo",
        "ddp",
        False,
    )
    assert plan.dataloader_workers == 0 and plan.pin_memory is False
    assert set(plan.to_dict()) >= PLAN_JSON_KEYS


def test_auto_world_size_picks_most_devices_that_split_the_batch():
    cfg = config_from_dict({"train": {"global_batch_size": 60}})
    assert make_plan(cfg, make_env(cpus=8)).world_size == 6


def test_auto_plan_on_gpus_uses_bf16_nccl_and_pins_memory():
    plan = make_plan(config_from_dict({}), make_env(cpus=32, gpus=4, gpu=A100))
    assert (plan.world_size, plan.precision, plan.backend, plan.tf32, plan.pin_memory) == (
        4,
        "bf16",
        "nccl",
        True,
        True,
    )


def test_global_batch_is_the_same_for_any_world_size():
    for workers in (1, 2, 4, 8, 16, 32, 64):
        cfg = config_from_dict(
            {
                "scaling": {"num_workers": workers},
                "train": {"global_batch_size": 256, "max_batch_per_worker": 16},
            }
        )
        plan = make_plan(cfg, make_env(cpus=128, source="ray cluster"))
        assert plan.effective_batch_size == 256
        assert plan.per_worker_batch_size * workers * plan.grad_accum_steps == 256


def test_too_many_workers_for_this_machine_names_the_key():
    cfg = config_from_dict({"scaling": {"num_workers": 8}})
    with pytest.raises(PlanError, match="scaling.num_workers=8"):
        make_plan(cfg, make_env(cpus=2))


def test_too_many_workers_for_a_slurm_allocation_names_the_sbatch_flags():
    env = replace(
        make_env(cpus=4, source="ray cluster"),
        slurm=SlurmInfo(job_id="7", num_nodes=2, ntasks=2, cpus_per_task=2, gpus_per_node=None),
    )
    cfg = config_from_dict({"scaling": {"num_workers": 8}})
    with pytest.raises(PlanError, match="SLURM allocation.*--cpus-per-task"):
        make_plan(cfg, env)
    assert make_plan(config_from_dict({"scaling": {"num_workers": 4}}), env).world_size == 4


def two_node_allocation(cpus_per_node: int, gpus_per_node: int | None = None) -> Environment:
    """The environment inside ``sbatch -N 2`` with the given CPUs (and GPUs) per node."""
    variables = {
        "SLURM_JOB_ID": "9",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_CPUS_PER_TASK": str(cpus_per_node),
        "SLURM_JOB_CPUS_PER_NODE": f"{cpus_per_node}(x2)",
    }
    if gpus_per_node:
        variables["SLURM_GPUS_ON_NODE"] = str(gpus_per_node)
    return replace(detect_environment(variables), gpu=A100 if gpus_per_node else None)


def test_a_slurm_allocation_is_planned_with_every_node_not_the_one_planning():
    env = two_node_allocation(cpus_per_node=1)
    plan = make_plan(config_from_dict({"scaling": {"num_workers": 2}}), env)
    assert (plan.world_size, plan.fits) == (2, True)
    assert make_plan(config_from_dict({}), env).world_size == 2  # auto: one per node
    with pytest.raises(PlanError, match="more than the 2 workers this SLURM allocation"):
        make_plan(config_from_dict({"scaling": {"num_workers": 3}}), env)


def test_gpus_of_every_allocated_node_count():
    """sbatch --nodes=2 --gpus-per-node=4 ... --set scaling.num_workers=8."""
    env = two_node_allocation(cpus_per_node=16, gpus_per_node=4)
    plan = make_plan(config_from_dict({"scaling": {"num_workers": 8}}), env)
    assert (plan.world_size, plan.use_gpu, plan.fits) == (8, True, True)


def test_a_worker_never_spans_two_nodes():
    env = two_node_allocation(cpus_per_node=3)  # 6 CPUs, but 2 per worker fit once per node
    cfg = config_from_dict({"scaling": {"num_workers": 3, "cpus_per_worker": 2}})
    with pytest.raises(PlanError, match="more than the 2 workers"):
        make_plan(cfg, env)


def test_the_preview_plans_any_worker_count_and_says_whether_it_fits(caplog):
    cfg = config_from_dict({"scaling": {"num_workers": 8}})
    with caplog.at_level("WARNING"):
        plan = make_plan(cfg, make_env(cpus=2), preview=True)
    assert (plan.world_size, plan.per_worker_batch_size, plan.fits) == (8, 8, False)
    assert plan.to_dict()["fits"] is False
    assert "scaling.num_workers=8 needs more than the 2 workers this machine" in caplog.text
    assert make_plan(config_from_dict({}), make_env(cpus=2), preview=True).fits is True


def test_single_strategy_forces_one_worker():
    cfg = config_from_dict({"distributed": {"strategy": "single"}})
    assert make_plan(cfg, make_env(cpus=8)).world_size == 1
    cfg = config_from_dict({"distributed": {"strategy": "single"}, "scaling": {"num_workers": 2}})
    with pytest.raises(PlanError, match="scaling.num_workers=1"):
        make_plan(cfg, make_env(cpus=8))


def test_use_gpu_without_gpus_is_an_error():
    cfg = config_from_dict({"scaling": {"use_gpu": True}})
    with pytest.raises(PlanError, match="scaling.use_gpu=true"):
        make_plan(cfg, make_env())


def test_loader_processes_follow_the_cpus_each_worker_has():
    cfg = config_from_dict({"scaling": {"cpus_per_worker": 4}})
    assert make_plan(cfg, make_env(cpus=8)).dataloader_workers == 3
    cfg = config_from_dict({"dataloader": {"num_workers": 5}})
    assert make_plan(cfg, make_env(cpus=8)).dataloader_workers == 5


def test_loader_processes_on_a_slurm_gpu_node_use_the_task_cpus_per_gpu():
    env = replace(
        make_env(cpus=32, gpus=4, gpu=A100),
        slurm=SlurmInfo(job_id="7", num_nodes=1, ntasks=1, cpus_per_task=32, gpus_per_node=4),
    )
    plan = make_plan(config_from_dict({}), env)
    assert (plan.world_size, plan.dataloader_workers) == (4, 7)


def test_resolved_config_has_no_auto_left():
    cfg = config_from_dict({})
    resolved = resolve_config(cfg, make_plan(cfg, make_env(cpus=2)))
    dumped = resolved.model_dump()
    flat = [
        dumped["scaling"]["num_workers"],
        dumped["scaling"]["use_gpu"],
        dumped["distributed"]["strategy"],
        dumped["distributed"]["backend"],
        dumped["precision"],
        dumped["dataloader"]["num_workers"],
        dumped["dataloader"]["pin_memory"],
    ]
    assert "auto" not in flat
    assert make_plan(resolved, make_env(cpus=2)) == make_plan(cfg, make_env(cpus=2))


@pytest.mark.parametrize(
    ("overrides", "env", "setting"),
    [
        ({"optimizations": {"compile": True}}, make_env(cpus=2), "optimizations.compile=true"),
        ({"train": {"max_batch_per_worker": "auto"}}, make_env(2, 2, A100), "max_batch_per_worker"),
        ({}, make_env(cpus=4, gpus=2, gpu=V100), "precision=fp16"),  # auto on a V100
        ({"experiment": {"output_dir": "s3://bucket/runs"}}, make_env(cpus=2), "s3://bucket/runs"),
    ],
)
def test_fsdp_refuses_what_no_test_proves_in_one_line(overrides, env, setting):
    cfg = config_from_dict(
        {"distributed": {"strategy": "fsdp"}, "scaling": {"num_workers": 2}, **overrides}
    )
    with pytest.raises(PlanError, match="or set distributed.strategy=ddp$") as err:
        make_plan(cfg, env)
    message = str(err.value)
    assert "\n" not in message and setting in message and "distributed.strategy=fsdp" in message


def test_fsdp_on_a_recent_gpu_runs_uncompiled_in_bf16():
    cfg = config_from_dict({"distributed": {"strategy": "fsdp"}, "scaling": {"num_workers": 2}})
    plan = make_plan(cfg, make_env(cpus=4, gpus=2, gpu=A100))
    assert (plan.strategy, plan.precision, plan.compile) == ("fsdp", "bf16", False)
    ddp = make_plan(config_from_dict({"scaling": {"num_workers": 2}}), make_env(4, 2, A100))
    assert ddp.compile  # DDP keeps compile on by default on the same GPU
