"""Elastic runs (``scaling.num_workers: [min, max]``): checked up front so that every size
Ray may pick trains the same optimisation, and re-split for the size the workers get."""

from __future__ import annotations

import pytest
from environments import A100, make_env

from raytrain_app.config import ConfigError, config_from_dict, config_to_dict
from raytrain_app.planning.batch import PlanError
from raytrain_app.planning.rules import make_plan, plan_for_world_size, resolve_config


def elastic(low: int, high: int, **train) -> dict:
    return {"scaling": {"num_workers": [low, high]}, "train": train}


@pytest.mark.parametrize("cap", [None, 8])
def test_every_size_in_the_range_trains_the_same_global_batch_and_lr(cap):
    cfg = config_from_dict(elastic(1, 4, global_batch_size=96, max_batch_per_worker=cap))
    plan = make_plan(cfg, make_env(cpus=4))
    assert (plan.world_size, plan.worker_range) == (4, (1, 4))
    for size in range(1, 5):
        sized = plan_for_world_size(plan, size)
        assert sized.world_size == size
        assert sized.per_worker_batch_size * size * sized.grad_accum_steps == 96
        assert cap is None or sized.per_worker_batch_size <= cap
        assert (sized.effective_batch_size, sized.lr, sized.worker_range) == (96, plan.lr, (1, 4))


def test_a_size_that_cannot_split_the_batch_is_refused_with_a_range_that_can():
    cfg = config_from_dict(elastic(1, 4, global_batch_size=64))
    with pytest.raises(PlanError) as info:
        make_plan(cfg, make_env(cpus=4))
    message = str(info.value)
    assert message.startswith("train.global_batch_size=64 cannot be split evenly over 3 workers")
    assert "scaling.num_workers=[1, 4]" in message
    assert "narrow it to scaling.num_workers=[1, 2]" in message
    assert "a multiple of 12 (e.g. 60 or 72)" in message and "\n" not in message


@pytest.mark.timeout(20)
def test_a_range_too_wide_for_any_batch_is_one_short_line():
    # the least common multiple of 1..100000 has 43 000 digits: it took seconds, then failed
    # with Python's int-to-str limit as a traceback, after listing 99 990 sizes
    cfg = config_from_dict(elastic(1, 100_000, global_batch_size=64))
    with pytest.raises(PlanError) as info:
        make_plan(cfg, make_env(cpus=4))
    message = str(info.value)
    assert message.startswith("train.global_batch_size=64 cannot be split evenly over 3, 5, 6")
    assert (
        "and 99985 more workers" in message and "narrow it to scaling.num_workers=[1, 2]" in message
    )
    assert "multiple of" not in message and len(message) < 400 and "\n" not in message


def test_a_range_without_a_valid_part_suggests_a_fixed_size_or_a_batch():
    cfg = config_from_dict(elastic(2, 8, global_batch_size=64))
    with pytest.raises(PlanError, match=r"over 3, 5, 6 or 7 workers.*a fixed scaling.num_workers"):
        make_plan(cfg, make_env(cpus=8))


def test_every_size_stays_under_the_memory_cap_with_more_accumulation_when_fewer():
    cfg = config_from_dict(elastic(1, 3, global_batch_size=96, max_batch_per_worker=16))
    plan = make_plan(cfg, make_env(cpus=4))
    assert [plan_for_world_size(plan, w).grad_accum_steps for w in (1, 2, 3)] == [6, 3, 2]


def test_powersgd_is_refused_because_a_resize_would_drop_its_state():
    cfg = config_from_dict({**elastic(1, 2), "distributed": {"grad_compression": "powersgd"}})
    with pytest.raises(PlanError, match="distributed.grad_compression=powersgd"):
        make_plan(cfg, make_env(cpus=2))


def test_an_elastic_run_needs_restarts_to_survive_a_lost_worker():
    cfg = config_from_dict({**elastic(1, 2), "fault_tolerance": {"max_failures": 0}})
    with pytest.raises(PlanError, match="set fault_tolerance.max_failures above 0"):
        make_plan(cfg, make_env(cpus=2))


def test_the_target_must_host_min_workers_and_may_lack_room_for_max():
    plan = make_plan(config_from_dict(elastic(1, 8, global_batch_size=840)), make_env(cpus=2))
    assert plan.fits and plan.world_size == 8
    with pytest.raises(PlanError, match="scaling.num_workers=3 needs more than the 2 workers"):
        make_plan(config_from_dict(elastic(3, 4, global_batch_size=96)), make_env(cpus=2))
    preview = make_plan(
        config_from_dict(elastic(3, 4, global_batch_size=96)), make_env(cpus=2), preview=True
    )
    assert not preview.fits


def test_the_resolved_config_keeps_the_range_and_reloads_equal():
    cfg = config_from_dict(elastic(1, 2))
    resolved = resolve_config(cfg, make_plan(cfg, make_env(cpus=2)))
    assert resolved.scaling.num_workers == [1, 2]
    assert config_from_dict(config_to_dict(resolved)) == resolved


def test_one_worker_of_a_range_compresses_nothing_and_gpus_plan_the_same_way():
    cfg = config_from_dict({**elastic(1, 2), "distributed": {"grad_compression": "bf16"}})
    plan = make_plan(cfg, make_env(cpus=16, gpus=2, gpu=A100))
    assert plan.grad_compression == "bf16" and plan.use_gpu
    assert plan_for_world_size(plan, 1).grad_compression == "none"


@pytest.mark.parametrize(
    ("value", "expected"),
    [([2, 1], "needs min <= max, got [2, 1]"), ([0, 2], "[min, max]"), ([1, 2, 3], "[min, max]")],
)
def test_a_bad_range_names_the_key(value, expected):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"scaling": {"num_workers": value}})
    assert "'scaling.num_workers'" in str(info.value) and expected in str(info.value)


def test_an_equal_range_is_a_fixed_size():
    assert config_from_dict(elastic(2, 2)).scaling.num_workers == 2
