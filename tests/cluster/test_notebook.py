"""Run notebooks_driver/quickstart.ipynb in a real Jupyter kernel, small, start to end."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import ipykernel.kernelspec
import nbformat
import pytest
from nbclient import NotebookClient
from paths import ROOT

from raytrain_app.testing.isolation import isolated_env

pytestmark = pytest.mark.cluster

QUICKSTART = ROOT / "notebooks_driver" / "quickstart.ipynb"
EPOCHS = 1
SWEEP_SAMPLES = 2
# The synthetic data shrunk to under a quarter of a year: the test checks the notebook
# runs end to end, not what the model learns.
EXTRA = ["data.params.num_hours=2000"]
# Appended to the executed copy: which Python the kernel really runs.
PROBE = "import json, sys\nprint(json.dumps({'prefix': sys.prefix}))"


def _with_test_parameters(nb: nbformat.NotebookNode, output_dir: Path) -> None:
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    cell.source = "\n".join(
        [
            f"EPOCHS = {EPOCHS}",
            "WORKERS = 2",
            "ADDRESS = None",
            f"SWEEP_SAMPLES = {SWEEP_SAMPLES}",
            "SWEEP_EPOCHS = 1",
            f"OUTPUT_DIR = {str(output_dir)!r}",
            f"EXTRA = {EXTRA!r}",
        ]
    )
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))


def _rows(path: Path) -> int:
    with path.open(newline="") as handle:
        return len(list(csv.DictReader(handle)))


@pytest.fixture
def venv_kernel(tmp_path, monkeypatch) -> str:
    """A 'python3' kernelspec that runs this interpreter, found first on JUPYTER_PATH."""
    prefix = tmp_path / "jupyter"
    ipykernel.kernelspec.install(kernel_name="python3", prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    return "python3"


def test_quickstart_notebook_runs(tmp_path, venv_kernel, ray_tmp):
    nb = nbformat.read(QUICKSTART, as_version=4)
    output_dir = tmp_path / "runs"
    _with_test_parameters(nb, output_dir)
    # Isolated for the Ray that the kernel starts; MPLBACKEND left out: the kernel's inline
    # backend renders the plots.
    env = isolated_env(tmp_path / "home", without=("MPLBACKEND",), RAY_TMPDIR=ray_tmp)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name=venv_kernel,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute(env=env)  # raises CellExecutionError; the kernel stops its Ray

    probe = json.loads(nb.cells[-1].outputs[0]["text"])
    assert Path(probe["prefix"]).resolve() == Path(sys.prefix).resolve()

    (loss_cell,) = [c for c in nb.cells if "loss-plot" in c.metadata.get("tags", [])]
    assert any("image/png" in out.get("data", {}) for out in loss_cell.outputs)

    assert _rows(output_dir / "notebook" / "metrics.csv") == EPOCHS
    assert _rows(output_dir / "notebook_sweep" / "trials.csv") == SWEEP_SAMPLES
    assert (output_dir / "notebook_sweep" / "best_config.yaml").is_file()
