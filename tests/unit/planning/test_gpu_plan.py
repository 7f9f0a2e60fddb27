"""The plan's GPU arithmetic and GPU choices against faked environments (no GPU, no Ray):
workers counted at the share Ray reserves for each, what NCCL refuses, torchrun's processes
under local mode, TF32 under fp32, the workers' GPU rather than the driver's, and the notes
``raytrain plan`` prints."""

from __future__ import annotations

from dataclasses import replace

import pytest
import ray
from environments import A100, H100, T4, V100, make_env

from raytrain_app.config import config_from_dict
from raytrain_app.planning import cluster_resources
from raytrain_app.planning.batch import PlanError
from raytrain_app.planning.environment import TorchrunInfo
from raytrain_app.planning.gpus import check_local_processes
from raytrain_app.planning.plan_text import format_plan as _format_plan
from raytrain_app.planning.rules import make_plan
from raytrain_app.sweep.results import best_config as _best_config
from raytrain_app.sweep.trials import single_worker, trial_environment


def _cfg(**sections) -> object:
    return config_from_dict(sections)


# --- scaling.gpus_per_worker ----------------------------------------------------------------


def test_auto_counts_workers_at_the_gpus_ray_reserves_for_each():
    # 8 GPUs at 2 per worker host 4 workers; counting one per GPU planned 8, and Ray then
    # waited forever for the 16 GPUs they reserve.
    plan = make_plan(_cfg(scaling={"gpus_per_worker": 2}), make_env(cpus=64, gpus=8, gpu=A100))
    assert (plan.world_size, plan.gpus_per_worker, plan.per_worker_batch_size) == (4, 2.0, 16)


def test_explicit_workers_that_need_more_gpus_than_the_machine_has_are_refused():
    cfg = _cfg(scaling={"num_workers": 4, "gpus_per_worker": 2})
    with pytest.raises(PlanError, match=r"scaling.num_workers=4 needs more than the 2 workers"):
        make_plan(cfg, make_env(cpus=64, gpus=4, gpu=A100))


def test_a_worker_never_spans_two_nodes_of_gpus():
    # two nodes of 3 GPUs: one 2-GPU worker each, not 3 (6 GPUs / 2)
    env = make_env(cpus=64, gpus=6, gpu=A100, node_gpus=(3.0, 3.0))
    plan = make_plan(_cfg(scaling={"gpus_per_worker": 2}), env)
    assert plan.world_size == 2


@pytest.mark.parametrize("workers", [2, "auto"])
def test_a_fraction_of_a_gpu_for_several_ddp_workers_is_refused_in_one_line(workers):
    # Ray would pack both workers onto one GPU, and NCCL refuses two ranks there
    # ("Duplicate GPU detected").
    cfg = _cfg(scaling={"num_workers": workers, "gpus_per_worker": 0.5})
    with pytest.raises(PlanError) as info:
        make_plan(cfg, make_env(cpus=8, gpus=1, gpu=A100))
    message = str(info.value)
    assert "scaling.gpus_per_worker=0.5" in message and "NCCL" in message
    assert "scaling.gpus_per_worker=1" in message and "\n" not in message
    assert info.value.exit_code == 2


def test_a_fraction_of_a_gpu_is_fine_for_one_worker_or_over_gloo():
    alone = make_plan(
        _cfg(scaling={"num_workers": 1, "gpus_per_worker": 0.5}), make_env(gpus=1, gpu=A100)
    )
    assert (alone.world_size, alone.gpus_per_worker) == (1, 0.5)
    cfg = _cfg(scaling={"num_workers": 2, "gpus_per_worker": 0.5}, distributed={"backend": "gloo"})
    assert make_plan(cfg, make_env(gpus=1, gpu=A100)).world_size == 2


def test_more_than_one_gpu_must_be_whole_gpus():
    with pytest.raises(PlanError, match=r"scaling.gpus_per_worker=1.5 .* set it to 1 or 2"):
        make_plan(_cfg(scaling={"gpus_per_worker": 1.5}), make_env(cpus=8, gpus=4, gpu=A100))


def test_workers_with_several_gpus_are_told_they_train_on_one():
    plan = make_plan(_cfg(scaling={"gpus_per_worker": 2}), make_env(cpus=8, gpus=4, gpu=A100))
    assert any("reserves 2 GPUs and trains on one" in note for note in plan.notes)


@pytest.mark.parametrize("share", [0.25, 1.0, 2.0])
def test_a_tune_trial_is_planned_with_the_gpu_share_it_reserved(share):
    cfg = single_worker(_cfg(scaling={"gpus_per_worker": share}))
    cluster = make_env(cpus=16, gpus=4, gpu=A100, source="ray cluster")
    plan = make_plan(cfg, trial_environment(cluster, cfg, use_gpu=True))
    # the memory probe budgets by this share of the GPU
    assert (plan.world_size, plan.gpus_per_worker, plan.precision) == (1, share, "bf16")


def test_the_best_trial_of_a_sweep_that_shared_gpus_trains_on_whole_ones():
    cfg = _cfg(scaling={"gpus_per_worker": 0.25})
    best = _best_config(cfg, {})
    assert best.scaling.gpus_per_worker == 1.0
    assert make_plan(best, make_env(cpus=8, gpus=4, gpu=A100)).world_size == 4


# --- torchrun's processes under --local ---------------------------------------------------


def _torchrun_env(processes: int, gpus: int):
    env = make_env(cpus=32, gpus=gpus, gpu=A100 if gpus else None)
    return replace(env, launcher="torchrun", torchrun=TorchrunInfo(0, 0, processes))


def test_more_torchrun_processes_than_gpus_are_refused_naming_nproc():
    cfg = _cfg(scaling={"num_workers": 4})  # local mode sets it to torchrun's world size
    with pytest.raises(PlanError) as info:
        make_plan(cfg, _torchrun_env(processes=4, gpus=2))
    assert str(info.value).startswith("--nproc 4 starts more processes than the 2 GPU(s)")
    assert "scaling.use_gpu=false" in str(info.value)


def test_torchrun_processes_on_cpu_or_one_per_gpu_are_planned():
    on_cpu = _cfg(scaling={"num_workers": 4, "use_gpu": False})
    assert make_plan(on_cpu, _torchrun_env(processes=4, gpus=2)).device == "cpu"
    one_each = make_plan(_cfg(scaling={"num_workers": 2}), _torchrun_env(processes=2, gpus=2))
    assert (one_each.world_size, one_each.use_gpu) == (2, True)


def test_torchrun_processes_count_per_node():
    # 2 nodes of 2 processes: 2 GPUs each suffice
    env = replace(_torchrun_env(processes=4, gpus=2), torchrun=TorchrunInfo(0, 0, 4, 2))
    check_local_processes(env)


# --- TF32 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "tf32"), [("auto", True), ("bf16", True), ("fp32", False), ("fp16", True)]
)
def test_tf32_is_off_under_an_explicit_fp32_and_the_plan_says_so(precision, tf32):
    env = make_env(cpus=8, gpus=1, gpu=A100)
    plan = make_plan(_cfg(precision=precision), env)
    assert plan.tf32 is tf32
    printed = _format_plan(env, plan)
    assert ("TF32 off: precision=fp32 keeps float32 matmuls" in printed) is (not tf32)
    assert ("TF32 matmul" in printed) is tf32


def test_no_tf32_before_ampere_whatever_the_precision():
    assert not make_plan(_cfg(precision="fp32"), make_env(gpus=1, gpu=V100)).tf32
    assert make_plan(_cfg(precision="fp32"), make_env(gpus=1, gpu=V100)).notes == ()


# --- compile with SyncBatchNorm ------------------------------------------------------------


def test_compile_with_sync_batchnorm_says_the_layers_run_outside_the_graphs():
    plan = make_plan(_cfg(), make_env(cpus=8, gpus=2, gpu=A100))
    assert (plan.compile, plan.sync_batchnorm) == (True, True)
    assert any("SyncBatchNorm layers" in note for note in plan.notes)
    alone = make_plan(_cfg(), make_env(cpus=8, gpus=1, gpu=A100))
    assert not any("SyncBatchNorm" in note for note in alone.notes)


# --- the workers' GPU, not the driver's -----------------------------------------------------

DRIVER, WORKER = "driver-node", "gpu-node"


def _node(node_id: str, gpus: float, model: str | None = None) -> dict:
    resources = {"CPU": 8.0, **({"GPU": gpus} if gpus else {})}
    if model:
        resources[f"accelerator_type:{model}"] = 1.0
    return {"NodeID": node_id, "Alive": True, "Resources": resources}


@pytest.fixture
def cluster(monkeypatch):
    """A connected Ray cluster as ``ray_cluster_resources`` sees it; the driver runs on
    ``DRIVER`` with a T4 of its own; ``asked`` records each query of a GPU node."""
    nodes: list[dict] = []
    asked: list[dict] = []
    models = {"H100": H100, "A100": A100, "T4": T4}

    def ask(resources):
        asked.append(resources)
        names = [key.split(":")[1] for key in resources] or ["H100"]
        return models[names[0]]

    monkeypatch.setattr(cluster_resources, "local_gpu", lambda: T4)
    monkeypatch.setattr(cluster_resources, "_gpu_on_a_node", ask)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(
        ray,
        "cluster_resources",
        lambda: {"CPU": 8.0 * len(nodes), "GPU": sum(n["Resources"].get("GPU", 0) for n in nodes)},
    )
    context = type("Context", (), {"get_node_id": lambda self: DRIVER})()
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    return nodes, asked


def test_a_cluster_is_planned_from_its_workers_gpus_not_the_drivers(cluster):
    # A laptop with a T4 planning for H100 workers picked fp16 and no compile.
    nodes, asked = cluster
    nodes += [_node(DRIVER, 1, "T4"), _node(WORKER, 8, "H100")]
    nodes[0]["Resources"].pop("GPU")  # the laptop's GPU is not the cluster's
    resources, gpu = cluster_resources.ray_cluster_resources()
    assert gpu == H100 and asked == [{"accelerator_type:H100": 0.001}]
    assert resources.node_gpus == (0.0, 8.0)
    laptop = make_env(cpus=8, gpus=1, gpu=T4)
    plan = make_plan(_cfg(), laptop.with_resources(resources, gpu))
    assert (plan.precision, plan.compile, plan.tf32, plan.world_size) == ("bf16", True, True, 8)


def test_of_several_gpu_models_the_least_capable_is_planned_for(cluster):
    nodes, asked = cluster
    nodes += [_node(DRIVER, 0), _node("a", 8, "H100"), _node("b", 8, "T4")]
    assert cluster_resources.ray_cluster_resources()[1] == T4  # bf16 would fail on the T4s
    assert len(asked) == 2


def test_the_drivers_own_gpu_is_read_where_it_is_the_only_gpu_node(cluster):
    nodes, asked = cluster
    nodes += [_node(DRIVER, 1, "T4"), _node("cpu-only", 0)]
    assert cluster_resources.ray_cluster_resources()[1] == T4 and asked == []


def test_a_cluster_without_gpus_is_planned_on_cpu_even_from_a_gpu_laptop(cluster):
    nodes, _ = cluster
    nodes += [_node(DRIVER, 0), _node(WORKER, 0)]
    resources, gpu = cluster_resources.ray_cluster_resources()
    assert gpu is None
    laptop = make_env(cpus=8, gpus=1, gpu=T4)
    plan = make_plan(_cfg(), laptop.with_resources(resources, gpu))
    assert (plan.use_gpu, plan.precision, plan.device) == (False, "fp32", "cpu")
    # asked for GPUs the cluster may grow, the plan does not borrow the laptop's T4 (fp16)
    waiting = make_plan(_cfg(scaling={"use_gpu": True}), laptop.with_resources(resources, gpu))
    assert (waiting.precision, waiting.fits) == ("fp32", False)  # Ray waits for GPUs


def test_a_gpu_query_that_finds_no_room_plans_for_an_unknown_gpu(monkeypatch, caplog):
    class Remote:
        def __init__(self, fn):
            pass

        def remote(self):
            return "ref"

    def busy(ref, timeout):
        raise ray.exceptions.GetTimeoutError(f"no GPU free in {timeout} s")

    cancelled = []
    monkeypatch.setattr(ray, "remote", lambda **options: Remote)
    monkeypatch.setattr(ray, "get", busy)
    monkeypatch.setattr(ray, "cancel", lambda ref, force: cancelled.append(ref))
    assert cluster_resources._gpu_on_a_node({}) is None
    assert cancelled == ["ref"]
    assert "set precision and optimizations.compile" in caplog.text
