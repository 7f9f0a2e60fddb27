"""A checkpoint is data, not code: hand-edited run directories run nothing.

A team shares run directories and buckets; anyone who can write there can edit a
checkpoint and rewrite its manifest. Each test edits a copy of one real finished run
(``raytrain train --local``) the way such a person would, then runs the command a
colleague would run on it, and checks both the one-line refusal and that nothing ran:
the payloads only ever create marker files.

Speed: a fresh ``python -m raytrain_app.cli`` pays several seconds of torch and Ray imports.
So one runner process (``forking_cli.ForkingCli``) imports the CLI once and forks a child
per command; the child takes the command's working directory (first on sys.path) and
environment, then runs ``sys.exit(cli.main())`` with its own stdout, stderr and exit status,
exactly as the entry point does. Nothing the commands load is imported before the fork (the
payload modules above all), so each child imports what the command imports, as a fresh
process would; and ``ray.init`` is left as it is, since a finished run is trained for real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from forking_cli import ForkingCli
from torch import nn

import raytrain_app as rt
from raytrain_app.checkpoint.store import (
    EMA_FILE,
    META_FILE,
    MODEL_FILE,
    TRAIN_STATE_FILE,
    write_manifest,
)
from raytrain_app.checkpoint.train_state import (
    LoopState,
    Trainables,
    load_resumable,
    save_resumable,
)
from raytrain_app.errors import BadInputError
from raytrain_app.predict import refuse_overwriting_data
from raytrain_app.storage import StorageLocation
from raytrain_app.sweep.restore_trust import check_restorable
from raytrain_app.testing.isolation import isolated_env
from raytrain_app.worker.model_companions import make_ema
from raytrain_app.workloads import FactoryRef

NAME = "shared"
CONFIG = {
    "experiment": {"name": NAME, "output_dir": "runs", "seed": 0},
    "model": {"name": "wind_transformer", "params": {"d_model": 16, "nhead": 2, "num_layers": 1}},
    "data": {"name": "synthetic_wind", "params": {"num_turbines": 2, "num_hours": 400}},
    "train": {"epochs": 2, "global_batch_size": 32},
    "scaling": {"num_workers": 1, "use_gpu": False},
    "dataloader": {"num_workers": 0},
    "tracking": {"tensorboard": False, "loss_plot": False},
}
SUPPORT = Path(__file__).parents[2] / "support" / "workloads"


class _Payload:
    """A pickle that runs a process when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _env(workspace: Path) -> dict[str, str]:
    """The environment of ``raytrain`` in ``workspace``, where user packages on PYTHONPATH
    are importable."""
    return isolated_env(
        workspace / "home",
        PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
        RAYTRAIN_TEST_MARKER=str(workspace / "marker"),
        CUDA_VISIBLE_DEVICES="",
    )


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Iterator[ForkingCli]:
    """The runner: it pre-imports the CLI, predict and training (with torch and Ray) and no
    payload, in its own workspace without the marker."""
    base = tmp_path_factory.mktemp("runner")
    (base / "io").mkdir()
    env = _env(base)
    del env["RAYTRAIN_TEST_MARKER"]  # the runner itself imports no payload
    forking = ForkingCli(
        cwd=base,
        env=env,
        io=base / "io",
        preimport=(
            "torch",
            "raytrain_app.cli",
            "raytrain_app.predict",
            "raytrain_app.driver.training",
        ),
    )
    yield forking
    forking.close()


def _run(runner: ForkingCli, workspace: Path, argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    """``raytrain <argv>`` as a fresh process in ``workspace``: its cwd (first on sys.path)
    and its environment."""
    done = runner.run(argv, timeout_s=300, cwd=workspace, env=_env(workspace))
    assert isinstance(done.returncode, int), f"raytrain {' '.join(argv)}: {done.returncode}"
    return done


@pytest.fixture
def cli(runner):
    """``raytrain <argv>`` in ``workspace``, where user packages on PYTHONPATH are importable."""

    def run(workspace: Path, *argv: str) -> subprocess.CompletedProcess:
        return _run(runner, workspace, argv)

    return run


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, runner) -> Path:
    """A workspace holding one real finished run, ``runs/shared`` (built-in model and data)."""
    workspace = tmp_path_factory.mktemp("finished")
    (workspace / "run.yaml").write_text(yaml.safe_dump(CONFIG))
    argv = ("train", "--local", "--no-progress", "--config", "run.yaml")
    done = _run(runner, workspace, argv)
    assert done.returncode == 0, done.stdout + done.stderr
    return workspace


@pytest.fixture
def workspace(finished_run, tmp_path) -> Path:
    """A copy of the finished run's workspace, for this test to edit."""
    copy = tmp_path / "work"
    shutil.copytree(finished_run, copy, symlinks=True)
    return copy


def _checkpoints(workspace: Path) -> list[Path]:
    return sorted((workspace / "runs" / NAME / "checkpoints").glob("*/checkpoint_*"))


def _edit_meta(checkpoint: Path, edit) -> None:
    """Edit meta.json as someone with write access would, manifest rewritten to match."""
    meta = json.loads((checkpoint / META_FILE).read_text())
    edit(meta)
    (checkpoint / META_FILE).write_text(json.dumps(meta))
    write_manifest(checkpoint)


def _name_launcher(workspace: Path, factory: str) -> None:
    """Every checkpoint's ``factory`` (model_factory or data_factory) names the launcher."""
    marker = str(workspace / "launched")
    for checkpoint in _checkpoints(workspace):
        _edit_meta(
            checkpoint,
            lambda meta: meta.update(
                {factory: {"target": "process_launcher:launch", "params": {"marker": marker}}}
            ),
        )


def _ran(workspace: Path) -> list[str]:
    """The markers any payload left: it was imported, called, or unpickled."""
    return sorted(p.name for p in workspace.iterdir() if p.name.startswith(("marker", "launched")))


@pytest.mark.parametrize("factory", ["model_factory", "data_factory"])
def test_predict_refuses_a_checkpoint_naming_a_process_launcher(workspace, cli, factory):
    _name_launcher(workspace, factory)

    message = _one_line_error(cli(workspace, "predict", "--checkpoint", f"runs/{NAME}"))

    assert "'process_launcher:launch'" in message and "--trust-code" in message, message
    assert _ran(workspace) == []
    assert not (workspace / "predictions.parquet").exists()


def test_export_refuses_a_checkpoint_naming_a_process_launcher(workspace, cli):
    _name_launcher(workspace, "model_factory")

    done = cli(workspace, "export", "--checkpoint", f"runs/{NAME}", "--output", "exported")
    message = _one_line_error(done)

    assert "'process_launcher:launch'" in message and "--trust-code" in message, message
    assert _ran(workspace) == []
    assert not (workspace / "exported").exists()


def test_load_model_refuses_it_and_runs_it_only_when_the_caller_trusts_the_code(
    workspace, monkeypatch
):
    _name_launcher(workspace, "model_factory")
    monkeypatch.syspath_prepend(str(SUPPORT))
    monkeypatch.setenv("RAYTRAIN_TEST_MARKER", str(workspace / "marker"))

    with pytest.raises(BadInputError, match="trust_code=True"):
        rt.load_model(workspace / "runs" / NAME)
    assert _ran(workspace) == []

    # The control: the gate, nothing else, is what kept the launcher from running.
    with pytest.raises(BadInputError, match="returned NoneType, not raytrain_app.ModelSpec"):
        rt.load_model(workspace / "runs" / NAME, trust_code=True)
    assert "launched" in _ran(workspace)


def test_the_factory_the_callers_own_config_names_is_called_without_trust_code(workspace):
    """A user's own model (model.target) loads when their config names it, as in a notebook
    that trained it; the same checkpoint is refused without that config."""
    checkpoint = _checkpoints(workspace)[-1]
    own = "raytrain_app.models.wind_transformer:build_for_tests"  # not a built-in name
    _edit_meta(checkpoint, lambda meta: meta["model_factory"].update(target=own))
    cfg = rt.config_from_dict({**CONFIG, "model": {"target": own, "params": {}}})

    with pytest.raises(BadInputError, match="--trust-code"):
        rt.load_model(checkpoint)
    with pytest.raises(BadInputError, match="has no attribute 'build_for_tests'"):
        rt.load_model(checkpoint, config=cfg)  # trusted: imported, then found missing


def test_a_module_inside_the_run_directory_is_never_imported_even_with_trust_code(
    workspace, monkeypatch
):
    """From a notebook whose working directory holds ``runs/``, a ``.py`` file dropped into a
    checkpoint folder is importable by name; raytrain refuses to import it."""
    checkpoint = _checkpoints(workspace)[-1]
    (checkpoint / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(workspace / 'marker')!r}).write_text('ran')\n"
        "def build(params, info):\n    pass\n"
    )
    module = ".".join(checkpoint.relative_to(workspace).parts) + ".evil"
    _edit_meta(checkpoint, lambda meta: meta["model_factory"].update(target=f"{module}:build"))
    monkeypatch.chdir(workspace)
    monkeypatch.syspath_prepend(str(workspace))

    with pytest.raises(BadInputError, match="never imports code from a run directory"):
        rt.load_model(checkpoint, trust_code=True)
    assert _ran(workspace) == [] and module not in sys.modules


def test_resume_refuses_a_train_state_carrying_a_pickle_payload(workspace, cli):
    newest = _checkpoints(workspace)[-1]
    torch.save({"epoch": 2, "payload": _Payload(workspace / "marker")}, newest / TRAIN_STATE_FILE)
    write_manifest(newest)

    done = cli(workspace, "train", "--local", "--no-progress", "--config", "run.yaml")

    message = _one_line_error(done)
    assert TRAIN_STATE_FILE in message and "unsupported GLOBAL posix.system" in message, message
    assert _ran(workspace) == []


@pytest.mark.parametrize("weights", [MODEL_FILE, EMA_FILE])
def test_resume_refuses_weights_carrying_a_pickle_payload_in_one_line(tmp_path, weights):
    torch.manual_seed(0)
    module = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(module.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    t = Trainables(module, module, optimizer, scheduler, scaler, make_ema(module, 0.9))
    directory = tmp_path / "checkpoint"
    save_resumable(directory, t, LoopState(), [], meta={})
    torch.save({"payload": _Payload(tmp_path / "marker")}, directory / weights)
    write_manifest(directory)

    with pytest.raises(BadInputError) as refused:
        load_resumable(directory, t, lr=None, device=torch.device("cpu"))

    message = str(refused.value)
    assert f"{weights}' holds objects other than tensors" in message and "\n" not in message
    assert not (tmp_path / "marker").exists()


def test_predict_refuses_edited_metadata_with_one_line(workspace, cli):
    checkpoint = _checkpoints(workspace)[-1]
    (checkpoint / META_FILE).write_text('{"model_factory": ')
    write_manifest(checkpoint)
    message = _one_line_error(cli(workspace, "predict", "--checkpoint", str(checkpoint)))
    assert f"{META_FILE}' is not valid JSON" in message, message

    (checkpoint / META_FILE).write_text(json.dumps({"model_factory": {"target": "x:y"}}))
    write_manifest(checkpoint)
    message = _one_line_error(cli(workspace, "predict", "--checkpoint", str(checkpoint)))
    assert "is not a raytrain checkpoint's metadata (data_info: field required)" in message


def test_predict_never_overwrites_the_data_the_checkpoint_trained_on(finished_run, cli, tmp_path):
    """Without --input, predictions are of the training data's validation split: an
    --output naming that file, by any spelling, is refused and the file left as it was.
    (On the finished run itself: its checkpoints name its own data file.)"""
    data = next((finished_run / "runs" / NAME / "data").glob("*.parquet"))
    before = data.read_bytes()
    (tmp_path / "link.parquet").symlink_to(data)
    spellings = [
        str(data),
        str(data.relative_to(finished_run)),
        f"runs/{NAME}/data/../data/{data.name}",
        str(tmp_path / "link.parquet"),
    ]
    for output in spellings:
        done = cli(finished_run, "predict", "--checkpoint", f"runs/{NAME}", "--output", output)
        message = _one_line_error(done)
        assert "the data the checkpoint trained on" in message, message
    assert data.read_bytes() == before


@pytest.mark.parametrize("data_path", ["data", "data/*.parquet", "data/a.parquet"])
@pytest.mark.parametrize("output", ["data/a.parquet", "data/b.parquet", "./data/../data/a.parquet"])
def test_an_output_that_would_become_part_of_the_data_is_refused(
    tmp_path, monkeypatch, data_path, output
):
    """A data folder or glob (data.path's forms) would read predictions written into it as
    training data next time: refused like the file itself. A file path only guards itself."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"x": [1.0]}), tmp_path / "data" / "a.parquet")
    ref = FactoryRef("raytrain_app.data.parquet_windows:build", {"path": data_path})
    joins = not (data_path == "data/a.parquet" and output == "data/b.parquet")
    if joins:
        with pytest.raises(BadInputError, match="would overwrite it"):
            refuse_overwriting_data(Path(output), ref, from_input=False)
    else:
        refuse_overwriting_data(Path(output), ref, from_input=False)


def test_predict_checks_the_output_folder_before_predicting(workspace, cli):
    done = cli(workspace, "predict", "--checkpoint", f"runs/{NAME}", "--output", "no/such.parquet")
    assert "the folder 'no' does not exist" in _one_line_error(done)


def test_resuming_a_sweep_that_is_not_this_users_is_refused(tmp_path):
    """Tune unpickles its saved state on restore: only a sweep directory wholly this user's
    (or, in a bucket, with --trust-code) is restored."""
    sweep = tmp_path / "tune"
    sweep.mkdir()
    state = sweep / "tuner.pkl"
    state.write_bytes(b"state")
    location = StorageLocation.parse(str(sweep), "experiment.output_dir")
    check_restorable(location, trust_code=False)  # the user's own: restored

    state.chmod(0o666)  # anyone could have replaced it
    with pytest.raises(BadInputError, match="tuner.pkl' is another user's or writable by"):
        check_restorable(location, trust_code=False)
    check_restorable(location, trust_code=True)
    state.chmod(0o644)

    if os.geteuid() == 0:  # root can hand the file to another user
        os.chown(state, 12345, 12345)
        with pytest.raises(BadInputError, match="another user's"):
            check_restorable(location, trust_code=False)

    bucket = SimpleNamespace(is_local=False, uri="s3://bucket/sweeps/tune")
    with pytest.raises(BadInputError, match="pass --trust-code if only people you trust"):
        check_restorable(bucket, trust_code=False)
