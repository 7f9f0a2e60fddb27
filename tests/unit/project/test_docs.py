"""The README stays true: its test command is what CI runs, its config table is the schema."""

from __future__ import annotations

import re

from paths import ROOT

from raytrain_app.config.reference import config_reference_markdown

README = (ROOT / "README.md").read_text()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    install, test = (block.strip() for block in _bash_blocks(quickstart)[:2])
    assert install.endswith("raytrain train")
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines()
    assert "torch==2.13.0" in install and "torch==2.13.0" in ci
    assert ci.index("torch==2.13.0") < ci.index('-e ".[dev]"')  # torch before the project


def test_readme_config_reference_is_the_schema():
    table = README.split("<!-- config-reference:start -->\n", 1)[1].split(
        "<!-- config-reference:end -->", 1
    )[0]
    assert table.strip() == config_reference_markdown().strip()
