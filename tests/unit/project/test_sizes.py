"""No module of raytrain_app over 400 lines and no function over 60: one job per module,
functions a reader takes in at once (issue 33). Split by responsibility, not by count."""

from __future__ import annotations

import ast

import pytest
from paths import ROOT

PACKAGE = ROOT / "raytrain_app"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MODULES = sorted(PACKAGE.rglob("*.py"))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """The functions and methods of ``source`` over ``limit`` lines (decorators excluded,
    docstring included), as ``name (lines)``."""
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, from line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{lines} lines: split it by responsibility"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_is_over_60_lines(path):
    assert long_functions(path.read_text()) == []


def test_the_check_counts_a_function_from_its_def_to_its_last_line():
    def function(lines: int) -> str:
        return "def f():\n" + "".join(f"    x = {i}\n" for i in range(lines - 1))

    assert long_functions(function(60)) == []
    assert long_functions(function(61)) == ["f (61 lines, from line 1)"]
