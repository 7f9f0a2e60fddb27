"""Environment detection from SLURM / torchrun variables (given as mappings, no monkeypatching
of the real environment needed), plus the defaults raytrain gives Ray Train."""

from __future__ import annotations

import io
import os
import sys

import pytest

from raytrain_app.planning.environment import (
    Resources,
    apply_ray_train_defaults,
    cluster_address,
    detect_environment,
    parse_slurm_counts,
    token_auth_without_a_token,
    training_worker_env_vars,
    unset_ray_train_defaults,
)


def test_plain_machine():
    env = detect_environment({})
    assert env.launcher == "local" and env.slurm is None and env.torchrun is None
    assert env.ray_address is None
    assert env.resources.cpus >= 1 and env.resources.source == "this machine"


def test_slurm_allocation():
    env = detect_environment(
        {
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": "2",
            "SLURM_CPUS_PER_TASK": "6",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_GPUS_PER_NODE": "a100:4",
            "RAY_ADDRESS": "10.0.0.1:6379",
        }
    )
    assert env.launcher == "slurm"
    assert (env.slurm.job_id, env.slurm.ntasks, env.slurm.num_nodes) == ("4242", 2, 2)
    assert env.slurm.cpus_per_task == 6 and env.slurm.gpus_per_node == 4
    # The plan's target is the whole allocation: each node's tasks' CPUs and its GPUs, x 2.
    resources = env.resources
    assert (resources.cpus, resources.gpus, resources.nodes) == (12, 8, 2)
    assert resources.source == "SLURM allocation" and resources.node_cpus == (6, 6)
    assert env.machine.cpus == 6  # what a Ray started on this node alone gets
    assert env.ray_address == "10.0.0.1:6379"


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("4", (4,)),
        ("2(x2)", (2, 2)),
        ("72(x2),36", (72, 72, 36)),
        ("", ()),
        (None, ()),
        ("2(x", ()),
    ],
)
def test_slurm_per_node_counts_in_slurms_compressed_form(text, counts):
    assert parse_slurm_counts(text) == counts


def test_a_two_node_allocation_of_one_cpu_each_is_two_cpus_on_two_nodes():
    """sbatch -N 2 --ntasks-per-node=1 --cpus-per-task=1, as seen by the batch script."""
    env = detect_environment(
        {
            "SLURM_JOB_ID": "9",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NTASKS": "2",
            "SLURM_CPUS_PER_TASK": "1",
            "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
        }
    )
    assert env.resources == Resources(
        cpus=2.0,
        gpus=0.0,
        nodes=2,
        source="SLURM allocation",
        node_cpus=(1.0, 1.0),
        node_gpus=(0.0, 0.0),
    )


def test_slurm_gpus_on_node_wins_and_garbage_is_ignored():
    env = detect_environment(
        {
            "SLURM_JOB_ID": "1",
            "SLURM_GPUS_ON_NODE": "8",
            "SLURM_GPUS_PER_NODE": "2",
            "SLURM_NTASKS": "x",
        }
    )
    assert env.slurm.gpus_per_node == 8 and env.slurm.ntasks == 1


def test_torchrun_variables():
    env = detect_environment(
        {"TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    )
    assert env.launcher == "torchrun"
    assert (env.torchrun.rank, env.torchrun.local_rank, env.torchrun.world_size) == (3, 1, 4)
    assert env.torchrun.local_world_size is None  # not set: one node
    two_nodes = {"LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert detect_environment(two_nodes).torchrun.local_world_size == 2


def test_environment_is_immutable():
    env = detect_environment({})
    try:
        env.launcher = "slurm"  # type: ignore[misc]
    except AttributeError:
        pass
    else:
        raise AssertionError("Environment must be frozen")


def test_ray_train_defaults_respect_the_user(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "1.5")
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PRINT_PATCH", raising=False)
    apply_ray_train_defaults()
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1.5"
    assert os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] == "0"


NICENESS = "RAY_worker_niceness"  # Ray's own spelling


def test_embedded_ray_defaults_only_for_an_embedded_ray(monkeypatch):
    monkeypatch.setattr(os, "environ", {})  # an empty environment, restored afterwards
    apply_ray_train_defaults()
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ
    assert NICENESS not in os.environ  # a cluster's workers keep Ray's 15
    monkeypatch.setenv("RAY_TRAIN_METRICS_ENABLED", "1")  # the user's choice stays
    added = apply_ray_train_defaults(embedded=True)
    assert added == ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", NICENESS]
    assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert os.environ[NICENESS] == "0"  # every worker of its Ray at nice 0
    assert os.environ["RAY_TRAIN_METRICS_ENABLED"] == "1"
    unset_ray_train_defaults(added)  # what raytrain's embedded Ray does when it stops
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ
    assert NICENESS not in os.environ
    assert os.environ["RAY_TRAIN_METRICS_ENABLED"] == "1"


def test_worker_lines_carry_no_colour_codes_where_output_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(os, "environ", {})
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a pipe, a log file
    apply_ray_train_defaults()
    assert os.environ["RAY_COLOR_PREFIX"] == "0"  # Ray's own switch for its prefix colours


def test_a_terminal_keeps_rays_colours_and_the_user_decides(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(os, "environ", {})
    monkeypatch.setattr(sys, "stdout", Terminal())
    monkeypatch.setattr(sys, "stderr", Terminal())
    apply_ray_train_defaults(embedded=True)
    assert "RAY_COLOR_PREFIX" not in os.environ
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    apply_ray_train_defaults()
    assert os.environ["RAY_COLOR_PREFIX"] == "1"


def test_training_workers_run_at_nice_0_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    assert training_worker_env_vars() == {"RAY_worker_niceness": "0"}
    monkeypatch.setenv("RAY_worker_niceness", "10")
    assert training_worker_env_vars() == {"RAY_worker_niceness": "10"}


def test_reads_the_real_process_environment(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    env = detect_environment()
    assert env.launcher == "slurm" and env.resources.cpus == 3 and env.ray_address == "auto"


def test_the_dashboard_ui_is_only_where_the_user_asks_for_it_on_the_interface_named():
    assert detect_environment({}).dashboard_host is None
    assert detect_environment({"RAYTRAIN_DASHBOARD_HOST": ""}).dashboard_host is None
    for host in ("127.0.0.1", "0.0.0.0"):
        assert detect_environment({"RAYTRAIN_DASHBOARD_HOST": host}).dashboard_host == host


@pytest.mark.parametrize(
    ("variables", "wanted"),
    [
        ({}, True),  # Ray's default for a local cluster: token auth, token generated
        ({"RAY_AUTH_MODE": "TOKEN"}, True),
        ({"RAY_AUTH_MODE": "disabled"}, False),
        ({"RAY_AUTH_TOKEN": "a" * 64}, False),
        ({"RAY_AUTH_TOKEN_PATH": "/run/secrets/ray-token"}, False),
    ],
)
def test_token_auth_wants_a_token_file_only_where_no_variable_gives_one(variables, wanted):
    assert token_auth_without_a_token(variables) is wanted


def test_the_cluster_address_is_rays_own_variable_and_an_empty_one_names_none():
    assert cluster_address({"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert cluster_address({"RAY_ADDRESS": ""}) is None
    assert cluster_address({}) is None
