"""`raytrain tune` on a real Ray: single-worker trials, ASHA, failures, best config."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import yaml

import raytrain_app as rt
from raytrain_app.cli import main
from raytrain_app.sweep.results import BEST_CONFIG_FILE, TRIALS_FILE

pytestmark = pytest.mark.distributed

TINY = {
    "data": {"params": {"num_turbines": 2, "num_hours": 1200, "stride": 4}},
    "model": {"params": {"d_model": 16, "dim_feedforward": 32}},
    "train": {"epochs": 3},
}


def sweep(tmp_path, name: str, tune: dict) -> dict:
    return {**TINY, "experiment": {"name": name, "output_dir": str(tmp_path)}, "tune": tune}


@pytest.fixture(scope="module")
def asha_sweep(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    cfg = sweep(
        out,
        "asha",
        {
            "num_samples": 2,  # x 2 grid values = 4 trials
            "max_concurrent_trials": 2,
            "scheduler": "asha",
            "grace_period": 1,
            "reduction_factor": 2,
            "param_space": {
                # One lr is clearly worse, so ASHA has a trial to stop early.
                "train.lr": {"grid": [3.0e-3, 1.0e-6]},
                "train.global_batch_size": {"choice": [32, 64]},
                "train.warmup_steps": {"randint": [0, 5]},
                "train.min_lr_ratio": {"quniform": [0.0, 0.5, 0.1]},
                "model.params.dropout": {"uniform": [0.0, 0.1]},
                "train.weight_decay": {"loguniform": [1.0e-4, 1.0e-2]},
            },
        },
    )
    return rt.tune(cfg)


def test_trials_table_has_every_trial_and_its_sampled_values(asha_sweep):
    trials = asha_sweep.trials
    assert len(trials) == 4
    assert sorted(trials["train.lr"]) == [1.0e-6, 1.0e-6, 3.0e-3, 3.0e-3]
    assert set(trials["train.global_batch_size"]) <= {32, 64}
    assert trials["train.warmup_steps"].between(0, 5).all()
    assert all(abs(v * 10 - round(v * 10)) < 1e-9 for v in trials["train.min_lr_ratio"])
    assert trials["model.params.dropout"].between(0.0, 0.1).all()
    assert trials["train.weight_decay"].between(1.0e-4, 1.0e-2).all()
    assert set(trials["status"]) <= {"completed", "stopped_early"}
    on_disk = (asha_sweep.run_dir / TRIALS_FILE).read_text().splitlines()
    assert len(on_disk) == 5  # header + one row per trial


def test_asha_stops_a_clearly_worse_trial_early(asha_sweep):
    trials = asha_sweep.trials
    stopped = trials[trials["status"] == "stopped_early"]
    assert len(stopped) >= 1
    assert (stopped["epochs"] < 3).all()
    assert (stopped["train.lr"] == 1.0e-6).any()


def test_each_trial_keeps_its_metrics_history(asha_sweep):
    for trial_id, epochs in zip(
        asha_sweep.trials["trial_id"], asha_sweep.trials["epochs"], strict=True
    ):
        rows = (asha_sweep.run_dir / "trials" / trial_id / "metrics.csv").read_text()
        assert len(rows.splitlines()) == epochs + 1


@pytest.mark.compat
def test_best_config_trains_distributed_with_the_trials_batch(asha_sweep, capsys):
    best = asha_sweep.best_config
    assert best.train.lr == 3.0e-3  # the good lr wins
    path = asha_sweep.run_dir / BEST_CONFIG_FILE
    assert rt.load_config(path) == best  # a complete, valid train config
    assert main(["plan", "--config", str(path), "--set", "scaling.num_workers=2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["effective_batch_size"] == best.train.global_batch_size
    assert (
        plan["per_worker_batch_size"] * 2 * plan["grad_accum_steps"] == plan["effective_batch_size"]
    )
    assert plan["lr"] == pytest.approx(3.0e-3)  # the tuned lr, not rescaled


def test_a_trial_that_raises_does_not_fail_a_sweep_of_the_hugging_face_example(
    ray_cluster, tmp_path
):
    """The Hugging Face example (examples/hf_causal_lm.py, a Llama from its config) under
    Tune: one trial trains it, the other's model factory raises and is one failed trial."""
    cfg = {
        "experiment": {"name": "failing", "output_dir": str(tmp_path)},
        "model": {"target": "hf_causal_lm:build_model", "params": {"hidden": 32, "layers": 1}},
        "data": {"target": "hf_causal_lm:build_data", "params": {"num_samples": 160}},
        "train": {"epochs": 1, "global_batch_size": 16, "lr": 3.0e-3},
        "tune": {
            "scheduler": "fifo",
            "num_samples": 1,  # the grid's two trials, once each
            # heads=3 cannot divide hidden=32: that trial's model factory raises.
            "param_space": {"model.params.heads": {"grid": [4, 3]}},
        },
    }
    result = rt.tune(cfg)
    assert len(result.trials) == 2
    by_head = dict(zip(result.trials["model.params.heads"], result.trials["status"], strict=True))
    assert by_head == {4: "completed", 3: "error"}
    error = result.trials.loc[result.trials["status"] == "error", "error"].iloc[0]
    assert "model.params.heads 3" in error
    assert result.best_config.model.params["heads"] == 4
    assert result.best_metrics["val_loss"] < math.log(256)  # it learned from a uniform guess
    assert "val_accuracy" in result.best_metrics  # the example's own metric, per token


def _trial_pids(run_dir) -> dict[str, set[int]]:
    """Each trial's process ids, from Tune's own result files."""
    pids: dict[str, set[int]] = {}
    for result_json in (run_dir / "tune").glob("*/result.json"):
        for line in result_json.read_text().splitlines():
            row = json.loads(line)
            pids.setdefault(row["trial_id"], set()).add(row["pid"])
    return pids


def test_a_reused_trial_process_starts_each_trial_clean(ray_cluster, tmp_path):
    """Three identical trials, two in one reused process, train bit-identically: on
    streaming data (``data.streaming: true``), which the sweep prepares once on Ray Data
    and every trial streams in the same order."""
    cfg = sweep(
        tmp_path,
        "reused",
        {
            "num_samples": 3,
            "max_concurrent_trials": 1,
            "scheduler": "fifo",
            "param_space": {"train.lr": {"choice": [1.0e-3]}},  # three identical trials
        },
    )
    cfg["train"] = {"epochs": 2}
    cfg["data"] = {**TINY["data"], "streaming": True}
    result = rt.tune(cfg)
    prepared = list((result.run_dir / "data" / "stream").glob("*/manifest.json"))
    assert len(prepared) == 1  # prepared once, by the sweep, for every trial
    assert yaml.safe_load(result.best_config_path.read_text())["data"]["streaming"] is True
    pids = _trial_pids(result.run_dir)
    assert len(pids) == 3 and len(set().union(*pids.values())) < 3  # a process ran 2+ trials
    columns = ["epoch", "step", "train_loss", "val_loss", "val_mae", "lr"]
    histories = [
        pd.read_csv(result.run_dir / "trials" / trial_id / "metrics.csv")[columns]
        for trial_id in result.trials["trial_id"]
    ]
    for history in histories[1:]:  # bit-identical to the first trial's, in its own process
        pd.testing.assert_frame_equal(history, histories[0], check_exact=True)


def _result_rows(run_dir) -> list[dict]:
    """Every result Tune recorded, from its own result files (each row carries the trial's
    config at that time)."""
    rows = []
    for result_json in sorted((run_dir / "tune").glob("*/result.json")):
        rows += [json.loads(line) for line in result_json.read_text().splitlines()]
    return rows


def test_pbt_continues_a_worse_trial_from_a_better_ones_checkpoint_with_a_mutated_lr(
    ray_cluster, tmp_path
):
    # Two trials side by side: at an epoch's report the worse one clones the better one's
    # checkpoint and continues with a perturbed copy of its lr.
    cfg = sweep(
        tmp_path,
        "pbt",
        {
            "num_samples": 2,
            "max_concurrent_trials": 2,
            "scheduler": "pbt",
            "param_space": {"train.lr": {"loguniform": [1.0e-6, 3.0e-3]}},
        },
    )
    # The sine regression, whose trials start training together (population.py): PBT
    # compares running trials only. 50 ms per step, under a second per epoch: at 0.1 s an
    # epoch, a trial starved for a moment on a busy machine (the cluster tier beside this
    # one under `pytest -n 2`) saw the other finish all four before its first report.
    population = {
        "population": 2,
        "population_dir": str(tmp_path / "population"),
        "sleep_s": 0.05,
    }
    cfg["model"] = {"target": "population:build_model", "params": population}
    cfg["data"] = {"target": "population:build_data", "params": {"num_samples": 1002}}
    # PBT clones another trial's latest checkpoint when it gets a slot, by which time that
    # trial may have written newer ones: keep them all (Tune warns for num_to_keep <= 2).
    # The lr never decays to 0, so even a trial continued only for the last epoch shows
    # which base lr it trained with.
    cfg["train"] = {
        "epochs": 4,
        "checkpoint_every_epochs": 1,
        "keep_checkpoints": None,
        "min_lr_ratio": 0.5,
    }
    result = rt.tune(cfg)
    assert (result.trials["status"] != "error").all(), result.trials["error"].tolist()
    # PBT's log of its exploits: [trial, cloned trial, their iterations, old config, new].
    exploits = [json.loads(line) for line in (result.run_dir / "tune" / "pbt_global.txt").open()]
    rows = _result_rows(result.run_dir)
    history = [(r["trial_id"], r["epoch"], r["config"]["train.lr"], r["val_loss"]) for r in rows]
    assert exploits, f"no trial was exploited: {history}"
    mutated_lrs = {new_config["train.lr"] for *_, new_config in exploits}
    continued = [row for row in rows if row["config"]["train.lr"] in mutated_lrs]
    assert continued, f"no trial reported with a mutated lr {mutated_lrs}: {history}"
    # Each epoch's lr is the trial's base lr times the schedule's factor for that epoch,
    # the same for every trial: so the continued trial trains with its mutated lr, not
    # the lr saved in the checkpoint it cloned.
    factors: dict[int, set[float]] = {}
    for row in rows:
        factors.setdefault(row["epoch"], set()).add(round(row["lr"] / row["config"]["train.lr"], 9))
    assert all(len(seen) == 1 and min(seen) > 0 for seen in factors.values()), factors
