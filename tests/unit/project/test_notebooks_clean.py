"""The notebooks in notebooks_driver/ are committed clean: valid v4, no outputs."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from paths import ROOT

NOTEBOOKS_DIR = ROOT / "notebooks_driver"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def test_notebooks_exist():
    names = {path.name for path in NOTEBOOKS}
    assert {"quickstart.ipynb", "submit_job.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_no_outputs(path):
    nb = _load(path)
    assert nb["nbformat"] == 4
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell["outputs"] == [], f"{path.name} cell {i} has outputs; strip them"
        assert cell["execution_count"] is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_nbformat_v4(path):
    nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[notebook]'")
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    assert nb.nbformat == 4
    nbformat.validate(nb)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_cells_parse(path):
    for cell in _load(path)["cells"]:
        if cell["cell_type"] == "code":
            ast.parse(_source(cell))


def test_quickstart_has_one_parameters_cell():
    cells = _load(NOTEBOOKS_DIR / "quickstart.ipynb")["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    assert tagged[0]["cell_type"] == "code"
    assigned = {
        target.id
        for node in ast.parse(_source(tagged[0])).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert {"EPOCHS", "WORKERS", "ADDRESS"} <= assigned
