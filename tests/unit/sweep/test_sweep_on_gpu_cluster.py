"""``raytrain tune`` on a GPU cluster, driven from a CPU-only host; no Ray runs.

The host sees no GPU; the cluster behind ``--address`` has two A100s. The sweep must be
checked against the cluster, and each trial must reserve ``scaling.gpus_per_worker``.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from environments import A100, make_env
from ray import tune

from raytrain_app.config import BUILTIN_SWEEP, load_config
from raytrain_app.driver import launch as driver_launch
from raytrain_app.planning.batch import PlanError
from raytrain_app.sweep import trials, tuning

CPU_HOST = make_env(cpus=4)
GPU_CLUSTER = make_env(cpus=32, gpus=2, gpu=A100, source="ray cluster")


class _Launched(Exception):
    """Raised where Tune would start the trials: everything before it has passed."""


@pytest.fixture
def launch(monkeypatch):
    """Run ``tune_sweep`` up to ``Tuner.fit`` from a CPU-only host against ``GPU_CLUSTER``;
    returns what Tune was handed: each trial's resources and the concurrency."""
    seen: dict = {}
    connected: list = []

    @contextmanager
    def fake_session(address, env):
        connected.append(address)
        yield GPU_CLUSTER

    def record_resources(trainable, resources):
        seen["resources"] = dict(resources)
        return trainable

    class FakeTuner:
        can_restore = staticmethod(lambda *args, **kwargs: False)

        def __init__(self, trainable, *, tune_config, **kwargs):
            seen["max_concurrent_trials"] = tune_config.max_concurrent_trials

        def fit(self):
            raise _Launched

    monkeypatch.setattr(driver_launch, "detect_environment", lambda: CPU_HOST)
    monkeypatch.setattr(driver_launch, "ray_session", fake_session)
    # check_shared asks the cluster's nodes
    monkeypatch.setattr(driver_launch, "check_shared", lambda *args: None)
    monkeypatch.setattr(tune, "with_resources", record_resources)
    monkeypatch.setattr(tune, "Tuner", FakeTuner)

    def run(tmp_path, *overrides: str) -> dict:
        cfg = load_config(
            None, [f"experiment.output_dir={tmp_path}", *overrides], builtin=BUILTIN_SWEEP
        )
        with pytest.raises(_Launched):
            tuning.tune_sweep(cfg, address="10.0.0.1:6379")
        assert connected == ["10.0.0.1:6379"]
        return seen

    return run


def test_trials_reserve_a_fraction_of_a_gpu_and_pack_several_per_gpu(launch, tmp_path):
    seen = launch(tmp_path, "scaling.use_gpu=true", "scaling.gpus_per_worker=0.25")
    assert seen["resources"] == {"cpu": 1.0, "gpu": 0.25}
    assert seen["max_concurrent_trials"] == 8  # 4 trials on each of the 2 GPUs


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_gpu_sweep_is_checked_against_the_cluster_not_the_cpu_only_host(
    launch, tmp_path, precision
):
    seen = launch(tmp_path, "scaling.use_gpu=true", f"precision={precision}")
    assert seen["resources"] == {"cpu": 1.0, "gpu": 1.0}
    assert seen["max_concurrent_trials"] == 2


def test_without_an_address_a_gpu_sweep_is_refused_on_a_cpu_only_host(monkeypatch, tmp_path):
    """Ray would start here, on this machine: refused before it starts, naming the key."""
    monkeypatch.setattr(driver_launch, "detect_environment", lambda: CPU_HOST)
    monkeypatch.setattr(driver_launch, "ray_session", None)  # never reached
    # No Ray in this process, as in a fresh `raytrain tune` (`pytest -n 2` runs unit tests
    # after a tier, whose session Ray may still be up in the same process).
    monkeypatch.setattr(driver_launch.ray, "is_initialized", lambda: False)
    cfg = load_config(
        None, [f"experiment.output_dir={tmp_path}", "scaling.use_gpu=true"], builtin=BUILTIN_SWEEP
    )
    with pytest.raises(PlanError, match="scaling.use_gpu=true but no GPU is visible"):
        tuning.tune_sweep(cfg)
    assert not (tmp_path / cfg.experiment.name).exists()


def test_trials_that_need_more_gpus_than_the_machine_has_are_refused(tmp_path):
    cfg = load_config(None, ["scaling.use_gpu=true", "scaling.gpus_per_worker=2"])
    with pytest.raises(PlanError, match="scaling.gpus_per_worker=2"):
        trials.check_trial_slots(cfg, make_env(cpus=8, gpus=1, gpu=A100), use_gpu=True)


@pytest.mark.parametrize(
    ("gpus", "share", "cpus", "expected"),
    [
        (1, 1.0, 8, 1),
        (1, 0.25, 8, 4),
        (2, 0.3, 32, 6),  # 3 per GPU, never one straddling two
        (1, 0.1, 32, 10),
        (4, 2.0, 32, 2),
        (2, 0.25, 4, 4),  # the CPUs, 1 per trial, bound it
    ],
)
def test_concurrent_trials_count_whole_gpus_and_cpus(gpus, share, cpus, expected):
    cfg = load_config(None, ["scaling.use_gpu=true", f"scaling.gpus_per_worker={share}"])
    env = make_env(cpus=cpus, gpus=gpus, gpu=A100, source="ray cluster")
    assert trials.concurrent_trials(cfg, env, use_gpu=True) == expected
