"""The user's recipe (issue 32): optimizer by import path, parameter groups, schedules, the
configure_optimizers hook and early stopping, run in this process or on two gloo ranks."""

from __future__ import annotations

import functools
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import cifar_resnet
import pytest
import recipe_probe
import torch
from environments import A100, make_env
from gloo_ranks import run_on_two_ranks
from loop_harness import TIMING_KEYS, Crash, LocalSession, assert_same_run, make_task, run_loop
from torch import nn

from raytrain_app.config import config_from_dict, load_config
from raytrain_app.errors import BadInputError
from raytrain_app.planning.recipe import check_schedule_length
from raytrain_app.planning.rules import make_plan
from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.worker.recipe import build_optimizer, param_groups

LR, DECAY, MILESTONES = 0.05, 5e-4, [1, 2]  # 16 steps per epoch: lr x0.1 at steps 16, 32
# The CIFAR recipe: SGD with Nesterov momentum, decay on the Linear weights only, multistep.
RECIPE = {
    "optimizer": {"target": "torch.optim:SGD", "params": {"momentum": 0.9, "nesterov": True}},
    "weight_decay": DECAY,
    "no_weight_decay": ["bias", "norm"],
    "schedule": {"name": "multistep", "milestones": MILESTONES, "gamma": 0.1, "unit": "epoch"},
    "grad_clip": None,
    "lr": LR,
}
EXAMPLES = Path(__file__).parents[3] / "examples"
STEP_LR, ONE_CYCLE = "torch.optim.lr_scheduler:StepLR", "torch.optim.lr_scheduler:OneCycleLR"
FUSED_AND_FOREACH = {"fused": True, "foreach": True}
PROBE = {"target": "recipe_probe:build_model", "params": {"batchnorm": True}}


def _task(root: Path, world_size: int = 1, **train: object) -> WorkerTask:
    task = make_task(root, model=PROBE, **{**RECIPE, **train})
    if world_size > 1:  # as the driver plans 2 workers: SyncBatchNorm, half the batch each
        task.config["scaling"]["num_workers"] = world_size
        task.plan = replace(
            task.plan,
            world_size=world_size,
            per_worker_batch_size=task.plan.effective_batch_size // world_size,
            sync_batchnorm=True,
        )
    return task


def _plain_pytorch_losses(batches: list, in_features: int) -> list[float]:
    """The same recipe written by hand, over the batches raytrain trained on."""
    torch.manual_seed(3)  # the harness's experiment.seed: the same initial weights
    module = nn.Sequential(
        nn.Linear(in_features, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Dropout(0.0), nn.Linear(32, 1)
    )
    weights = [m.weight for m in module if isinstance(m, nn.Linear)]
    rest = [p for p in module.parameters() if all(p is not w for w in weights)]
    groups = [{"params": weights, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(groups, lr=LR, momentum=0.9, nesterov=True)
    steps_per_epoch = 16
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, [m * steps_per_epoch for m in MILESTONES], gamma=0.1
    )
    losses = []
    module.train()
    for x, y, _ in batches:
        loss = nn.functional.mse_loss(module(x), y)
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return losses


def test_the_cifar_recipe_on_one_worker_matches_a_plain_pytorch_loop(tmp_path):
    recipe_probe.TRAINED.clear()
    task = _task(tmp_path)
    result, _ = run_loop(task, LocalSession(tmp_path / "ckpt"))
    trained = list(recipe_probe.TRAINED)
    assert len(trained) == 48
    ours = [loss for _, _, loss in trained]
    theirs = _plain_pytorch_losses(trained, trained[0][0].shape[1])
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert [row["lr"] for row in result["history"]] == pytest.approx([LR / 10, LR / 100, LR / 100])


def test_parameter_groups_split_decay_by_kind_and_pattern_and_scale_lr():
    train = config_from_dict(
        {"train": {"no_weight_decay": ["bias", "norm", "*.pos"], "lr_multipliers": {"2.*": 0.1}}}
    ).train
    module = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.Linear(2, 2), nn.Embedding(3, 2))
    module.get_submodule("0").register_parameter("pos", nn.Parameter(torch.zeros(1)))
    groups = param_groups(module, train, lr=1.0)
    layout = [(g["weight_decay"], g["lr"], len(g["params"])) for g in groups]
    # 0.weight, 3.weight | 0.bias, 0.pos, 1.weight, 1.bias | 2.weight | 2.bias
    assert layout == [(0.01, 1.0, 2), (0.0, 1.0, 4), (0.01, 0.1, 1), (0.0, 0.1, 1)]
    embedding = config_from_dict({"train": {"no_weight_decay": ["embedding"]}}).train
    assert [len(g["params"]) for g in param_groups(module, embedding, 1.0)] == [7, 1]


def _two_ranks(rank: int, tasks: tuple[WorkerTask, ...], root: str) -> list[dict]:
    torch.set_num_threads(1)
    out = []
    for index, task in enumerate(tasks):
        loop = WorkerLoop(task, _RankSession(Path(root) / f"ckpt{index}"))
        result = loop.run()
        out.append({**result, "names": [c.name for c in loop.session.checkpoints()]})
    return out


class _RankSession(LocalSession):
    """One of two gloo ranks: rank 0 persists the checkpoints (loop_harness's LocalSession)."""


def _close(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b, strict=True):
        for key in row_a.keys() - {*TIMING_KEYS, "world_size"}:
            assert row_a[key] == pytest.approx(row_b[key], rel=1e-4, abs=1e-6), key


STOPPING = {"early_stopping": {"patience": 1, "min_delta": 10.0}, "checkpoint_every_epochs": 3}


def test_two_gloo_workers_agree_with_one_and_stop_early_at_the_same_epoch(tmp_path):
    short = {"epochs": 2, "schedule": {**RECIPE["schedule"], "milestones": [1]}}
    one = run_loop(_task(tmp_path / "one", **short), LocalSession(tmp_path / "ckpt-one"))[0]
    tasks = (
        _task(tmp_path / "two", 2, **short),
        _task(tmp_path / "stop", 2, epochs=4, **STOPPING),
    )
    ranks = run_on_two_ranks(
        functools.partial(_two_ranks, tasks=tasks, root=str(tmp_path)), tmp_path
    )
    for rank in ranks:
        _close(rank[0]["history"], one["history"])
    # min_delta 10: epoch 1 is the best, epoch 2 no better, so patience 1 stops after it.
    assert [rank[1]["stopped_early_at_epoch"] for rank in ranks] == [2, 2]
    assert [len(rank[1]["history"]) for rank in ranks] == [2, 2]
    assert "stopped" not in ranks[0][1]  # finished, not stopped on request
    # checkpoint_every_epochs 3 would write none: the best epoch and the last are written.
    assert sorted(n.split("_")[1] for n in ranks[0][1]["names"]) == ["epoch0001", "epoch0002"]


def test_a_mid_epoch_resume_restores_optimizer_and_schedule_exactly(tmp_path):
    mid = {"checkpoint_every_steps": 5, "warmup_steps": 4}
    reference = run_loop(_task(tmp_path / "ref", **mid), LocalSession(tmp_path / "ref-ckpt"))
    storage = tmp_path / "ckpt"
    with pytest.raises(Crash):  # the 5th checkpoint: step 20, 4 steps into epoch 2
        run_loop(_task(tmp_path / "run", **mid), LocalSession(storage, crash_after_checkpoints=5))
    assert_same_run(run_loop(_task(tmp_path / "run", **mid), LocalSession(storage)), reference)


def test_early_stopping_resumes_its_count_after_a_crash_before_it_triggers(tmp_path):
    rule = {"early_stopping": {"patience": 2, "min_delta": 10.0}, "epochs": 5}
    reference = run_loop(_task(tmp_path / "ref", **rule), LocalSession(tmp_path / "ref-ckpt"))
    assert reference[0]["stopped_early_at_epoch"] == 3
    storage = tmp_path / "ckpt"
    with pytest.raises(Crash):  # after epoch 2: one epoch without improvement so far
        run_loop(_task(tmp_path / "run", **rule), LocalSession(storage, crash_after_checkpoints=2))
    resumed = run_loop(_task(tmp_path / "run", **rule), LocalSession(storage))
    assert resumed[0]["stopped_early_at_epoch"] == 3
    assert_same_run(resumed, reference)
    again = run_loop(_task(tmp_path / "run", **rule), LocalSession(storage))  # trains nothing
    assert again[0]["history"] == resumed[0]["history"]


def test_the_hook_builds_the_optimizer_and_refuses_recipe_keys_beside_it(tmp_path):
    hooked = {"target": "recipe_probe:build_model", "params": {"hook": True}}
    result, _ = run_loop(make_task(tmp_path, model=hooked, epochs=1), LocalSession(tmp_path / "c"))
    assert result["history"][0]["lr"] == pytest.approx(0.01 * 0.5)  # the hook's, constant
    task = make_task(tmp_path / "both", model=hooked, epochs=1, optimizer="sgd")
    with pytest.raises(BadInputError, match=r"configure_optimizers .* train\.optimizer is set"):
        run_loop(task, LocalSession(tmp_path / "c2"))


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"optimizer": {"target": "torch.optim:Lion"}}, r"train\.optimizer\.target: cannot import"),
        ({"optimizer": {"target": "torch.nn:Linear"}}, r"not a torch\.optim\.Optimizer"),
        (
            {"optimizer": {"target": "torch.optim:SGD", "params": {"betas": [0.9, 0.95]}}},
            r"train\.optimizer\.params: SGD does not accept betas",
        ),
        (
            {"optimizer": {"target": "torch.optim:SGD", "params": {"nesterov": True}}},
            r"train\.optimizer: SGD\(nesterov=True\) fails: Nesterov",
        ),
        ({"optimizer": {"target": "torch.optim:AdamW", "params": {"lr": 1}}}, r"use train\.lr"),
        (
            {"schedule": {"target": "torch.optim.lr_scheduler:ReduceLROnPlateau"}},
            r"train\.schedule\.target: .* ReduceLROnPlateau",
        ),
        (
            {"schedule": {"target": "torch.optim.lr_scheduler:StepLR", "params": {"size": 3}}},
            r"train\.schedule\.params: StepLR does not accept size",
        ),
        (  # each is tried on the driver with the workers' arguments, not just imported
            {"optimizer": {"target": "torch.optim:AdamW", "params": FUSED_AND_FOREACH}},
            r"train\.optimizer: AdamW\(fused=True, foreach=True\) fails: `fused` and `foreach`",
        ),
        (
            {"schedule": {"target": "torch.optim.lr_scheduler:StepLR"}},
            r"train\.schedule: StepLR\(\) fails: .*'step_size'.* fix train\.schedule\.params",
        ),
        (
            {"schedule": {"target": STEP_LR, "params": {"step_size": 0}, "unit": "step"}},
            r"train\.schedule: StepLR\(step_size=0\) fails: .*ZeroDivisionError",
        ),
        (
            {"schedule": {"target": STEP_LR, "params": {"step_size": 0}}, "warmup_steps": 5},
            r"train\.schedule: StepLR\(step_size=0\) fails",  # its first step is after warmup
        ),
        (
            {"schedule": {"target": ONE_CYCLE, "params": {"max_lr": 0.1}}},
            r"train\.schedule: OneCycleLR\(max_lr=0\.1\) fails: You must define.*total_steps",
        ),
        ({"schedule": {"name": "multistep", "milestones": [2, 5]}}, r"past the end of a 5-epoch"),
        ({"schedule": {"name": "multistep"}}, r"multistep needs milestones"),
        ({"no_weight_decay": [""]}, r"no_weight_decay"),
        ({"early_stopping": {"patience": 0}}, r"train\.early_stopping"),
    ],
)
def test_a_bad_recipe_is_one_line_naming_the_key_before_any_worker(train, message):
    with pytest.raises(BadInputError, match=message) as caught:
        make_plan(config_from_dict({"train": train}), make_env())
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("implementation", [{"foreach": True}, {"differentiable": True}])
def test_a_gpu_plan_keeps_the_optimizer_implementation_the_params_ask_for(implementation):
    """fused=True beside foreach or differentiable is refused by torch in every worker."""
    recipe = {"optimizer": {"target": "torch.optim:AdamW", "params": implementation}}
    cfg = config_from_dict({"train": recipe})
    plan = make_plan(cfg, make_env(cpus=8, gpus=1, gpu=A100))
    assert not plan.fused_optimizer
    optimizer = build_optimizer(nn.Linear(2, 1), cfg.train, plan)  # as a worker builds it
    assert all(not group["fused"] for group in optimizer.param_groups)
    default = make_plan(config_from_dict({}), make_env(cpus=8, gpus=1, gpu=A100))
    assert default.fused_optimizer  # otherwise still fused on GPUs


def test_a_milestone_in_steps_past_the_end_is_refused_once_the_steps_are_known():
    schedule = config_from_dict(
        {"train": {"schedule": {"name": "multistep", "milestones": [40], "unit": "step"}}}
    ).train.schedule
    check_schedule_length(schedule, total_steps=48, steps_per_epoch=16)
    with pytest.raises(BadInputError, match=r"multistep at step 40 .* 32 optimizer steps"):
        check_schedule_length(schedule, total_steps=32, steps_per_epoch=16)


def test_the_plan_shows_the_recipe():
    plan = make_plan(
        config_from_dict({"train": {**RECIPE, "early_stopping": {"patience": 2}}}), make_env()
    )
    assert (
        plan.optimizer == "SGD(momentum=0.9, nesterov=True), weight_decay 0.0005 except bias, norm"
    )
    assert plan.schedule == "warmup 0 steps, then multistep x0.1 at epoch [1, 2]"
    assert plan.early_stopping == "patience 2, min_delta 0"
    assert not plan.fused_optimizer


def test_the_cifar_example_decays_exactly_the_convolution_weights():
    cfg = load_config(EXAMPLES / "cifar_resnet.yaml")
    module = cifar_resnet.build_model(cfg.model.params, {"num_classes": 10}).module
    decayed = {
        id(p)
        for g in param_groups(module, cfg.train, 0.1)
        if g["weight_decay"]
        for p in g["params"]
    }
    convs = {id(m.weight) for m in module.modules() if isinstance(m, nn.Conv2d)}
    assert decayed == convs
    plan = make_plan(cfg, make_env())
    assert plan.optimizer.startswith("SGD(momentum=0.9, nesterov=True)")
    assert "multistep" in plan.schedule and plan.early_stopping


def test_a_sweep_reaches_the_optimizer_params():
    from raytrain_app.sweep.search_space import build_search_space, trial_config

    space = {"train.optimizer.params.momentum": {"choice": [0.8, 0.95]}}
    cfg = config_from_dict(
        {"train": {"optimizer": RECIPE["optimizer"]}, "tune": {"param_space": space}}
    )
    assert list(build_search_space(cfg)) == ["train.optimizer.params.momentum"]
    best = trial_config(cfg, {"train.optimizer.params.momentum": 0.95}).train.optimizer
    assert best.params == {"momentum": 0.95, "nesterov": True}
    with pytest.raises(BadInputError, match="'train.optimizer' holds the value 'adamw'"):
        build_search_space(config_from_dict({"tune": {"param_space": space}}))


def test_raytrain_plan_prints_the_recipe():
    from raytrain_app.planning.plan_text import format_plan as _format_plan

    cfg = config_from_dict({"train": {**RECIPE, "early_stopping": {"patience": 2}}})
    env = make_env()
    text = _format_plan(env, make_plan(cfg, env))
    assert "optimizer   : SGD(momentum=0.9, nesterov=True), weight_decay 0.0005 except bias" in text
    assert "then multistep x0.1 at epoch [1, 2]" in text
    assert "stopping    : early stopping on val_loss (patience 2, min_delta 0)" in text
    default = _format_plan(env, make_plan(config_from_dict({}), env))
    assert "warmup 0 steps, then cosine to 0x" in default


def test_a_tune_trial_its_rule_stopped_counts_as_finished():
    import pandas as pd

    from raytrain_app.sweep.results import stopped_by_rule as _stopped_by_rule

    cfg = config_from_dict({"train": {"epochs": 5, "early_stopping": {"patience": 1}}})
    history = pd.DataFrame({"epoch": [1, 2], "val_loss": [1.0, 1.5]})
    assert _stopped_by_rule(cfg, history, epochs=2)  # its own rule: completed, not failed
    improving = pd.DataFrame({"epoch": [1, 2], "val_loss": [1.0, 0.5]})
    assert not _stopped_by_rule(cfg, improving, epochs=2)  # ASHA stopped it


def test_planning_a_built_in_recipe_builds_no_optimizer():
    """A built-in optimizer and schedule are checked without building a torch optimizer,
    whose constructor imports torch._dynamo: 1.4 s of CPU that ``raytrain plan`` and a
    cold ``raytrain train`` (beside its embedded Ray's start) would pay for nothing. In a
    fresh process: this one has imported torch._dynamo long ago."""
    check = (
        "import sys\n"
        "from raytrain_app.config import config_from_dict\n"
        "from raytrain_app.planning.environment import detect_environment\n"
        "from raytrain_app.planning.rules import make_plan\n"
        "for name in ('adamw', 'adam', 'sgd'):\n"
        "    train = {'optimizer': name, 'schedule': {'name': 'step', 'step_size': 2}}\n"
        "    make_plan(config_from_dict({'train': train}), detect_environment())\n"
        "assert 'torch._dynamo' not in sys.modules, 'an optimizer was built'\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
