"""A Hugging Face model's checkpoint back out: ``load_model`` returns the ``transformers``
module, and ``raytrain export`` writes the run's best checkpoint in the Hugging Face layout
(``save_pretrained``: ``config.json`` and ``model.safetensors``) that ``from_pretrained``
reads, with the same loss; anything else is refused in one line and nothing is written.
The run is the HF example (``examples/hf_causal_lm.py``) trained in this process, no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hf_causal_lm
import pytest
import torch
import yaml
from loop_harness import LocalSession, make_task, run_loop, worker_task
from paths import ROOT
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import raytrain_app as rt
from raytrain_app.cli import main
from raytrain_app.config import config_from_dict
from raytrain_app.errors import BadInputError

DATA = {"num_samples": 120, "min_length": 16, "max_length": 40}
MODEL = {"hidden": 32, "layers": 1, "heads": 2}
CONFIG = {
    "experiment": {"name": "hf", "seed": 5},
    "model": {"target": "hf_causal_lm:build_model", "params": MODEL},
    "data": {"target": "hf_causal_lm:build_data", "params": DATA},
    "train": {"epochs": 2, "global_batch_size": 16, "lr": 3.0e-3},
    "scaling": {"num_workers": 1},
    "dataloader": {"num_workers": 0},
}


def _train(root: Path, raw: dict) -> tuple[Path, dict[str, torch.Tensor]]:
    """``raw`` trained in this process; its run directory, and the weights it ended at."""
    raw = {**raw, "experiment": {**raw["experiment"], "output_dir": str(root / "runs")}}
    cfg = config_from_dict(raw)
    run_dir = root / "runs" / cfg.experiment.name
    _, weights = run_loop(worker_task(cfg, run_dir), LocalSession(run_dir / "checkpoints"))
    return run_dir, weights


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The HF example's run directory, the config file it was trained with, its weights."""
    root = tmp_path_factory.mktemp("hf")
    run_dir, weights = _train(root, CONFIG)
    config_file = root / "hf.yaml"
    config_file.write_text(yaml.safe_dump(CONFIG))
    return run_dir, config_file, weights


def _val_batch():
    splits = hf_causal_lm.build_data(DATA, seed=5)
    return hf_causal_lm.pad_batch([splits.val[i] for i in range(len(splits.val))])


def test_load_model_returns_the_hugging_face_module_with_the_trained_weights(hf_run):
    run_dir, config_file, weights = hf_run
    model = rt.load_model(run_dir, config=config_file)
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[key]), key


def test_the_export_loads_with_from_pretrained_and_gives_the_same_loss(hf_run, tmp_path, capsys):
    run_dir, config_file, _ = hf_run
    output = tmp_path / "tiny-llama"
    argv = ["export", "--checkpoint", str(run_dir), "--output", str(output)]
    assert main([*argv, "--config", str(config_file)]) == 0
    assert f"exported to {output}" in capsys.readouterr().out
    assert {"config.json", "model.safetensors"} <= {p.name for p in output.iterdir()}
    assert json.loads((output / "config.json").read_text())["model_type"] == "llama"

    exported = AutoModelForCausalLM.from_pretrained(output)  # no raytrain involved
    assert isinstance(exported, LlamaForCausalLM)
    trained = rt.load_model(run_dir, config=config_file)
    batch = _val_batch()
    with torch.no_grad():
        expected = trained(**batch).loss
        assert exported(**batch).loss == expected
    assert expected < 0.9 * torch.log(torch.tensor(256.0))  # a trained model, not a fresh one


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    """A finished run of a model that is not a Hugging Face one."""
    root = tmp_path_factory.mktemp("plain")
    task = make_task(root, epochs=1)
    run_loop(task, LocalSession(Path(task.run_dir) / "checkpoints"))
    return Path(task.run_dir)


def _refused(capsys, *argv: str) -> str:
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_export_refuses_in_one_line_and_writes_nothing(hf_run, plain_run, tmp_path, capsys):
    run_dir, config_file, _ = hf_run
    new = tmp_path / "new"
    message = _refused(capsys, "--checkpoint", str(plain_run), "--output", str(new), "--trust-code")
    assert "not a Hugging Face transformers model" in message and "load_model" in message
    message = _refused(capsys, "--checkpoint", str(run_dir), "--output", str(new))
    assert "'hf_causal_lm:build_model'" in message and "--trust-code" in message
    assert not new.exists()

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    for output, expected in (
        (taken, "is a folder that is not empty"),
        (taken / "notes.txt", "is a file"),
        (tmp_path / "no" / "such", "does not exist"),
        ("s3://bucket/model", "is a URI"),
    ):
        message = _refused(
            capsys, "--checkpoint", str(run_dir), "--output", str(output), "-c", str(config_file)
        )
        assert expected in message and "--output" in message, message
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    assert (taken / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "no").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no scratch folder left


def test_predict_refuses_a_hugging_face_models_batches_in_one_line(hf_run, tmp_path, capsys):
    """Its batches are a BatchEncoding of input_ids, attention_mask and labels, not the
    (inputs, targets) predict writes a row per sample from."""
    run_dir, config_file, _ = hf_run
    output = tmp_path / "predictions.parquet"
    argv = ["predict", "--checkpoint", str(run_dir), "-c", str(config_file)]
    argv += ["--output", str(output)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "gives BatchEncoding batches" in err and "export" in err, err
    assert not output.exists()


def test_export_hf_is_the_python_api_of_the_command(hf_run, tmp_path):
    run_dir, config_file, weights = hf_run
    folder = rt.export_hf(run_dir, tmp_path / "out", config=config_file)
    model = LlamaForCausalLM.from_pretrained(folder)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[key]), key
    with pytest.raises(BadInputError, match="trust_code=True"):
        rt.export_hf(run_dir, tmp_path / "other")


def test_only_a_hugging_face_model_imports_transformers(plain_run, tmp_path):
    """raytrain's own paths, exporting included, leave transformers (seconds of imports)
    to the factories that build such models."""
    code = (
        "import sys; import raytrain_app.cli, raytrain_app.predict, raytrain_app.worker.loop, "
        "raytrain_app.driver.trainer, raytrain_app.checkpoint.export as export\n"
        "try:\n"
        f"    export.export_hf({str(plain_run)!r}, {str(tmp_path / 'out')!r}, trust_code=True)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__)\n"
        "print('transformers' in sys.modules)\n"
    )
    support = [ROOT / "tests" / "support", ROOT / "tests" / "support" / "workloads"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, support))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.split() == ["BadInputError", "False"], done.stdout + done.stderr
