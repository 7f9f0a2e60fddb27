"""The README and the pages of docs/ stay true: the README's test command is what CI runs, the
configuration reference is the schema, every test a page names exists and every claim names
its test, every link leads somewhere, and the site builds with ``mkdocs build --strict``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from paths import ROOT, TESTS

from raytrain_app.config.reference import config_reference_markdown

README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
DOCUMENTS = [README_PATH, *PAGES]
IDS = [str(path.relative_to(ROOT)) for path in DOCUMENTS]

# Words that say something is tested; a paragraph, list item or table row with one of them
# names its test: a path under tests/ or a test function.
CLAIM = re.compile(
    r"(?<!how it is )\btested\b|\bproven\b|\bproves?\b|\ba test\b"
    r"|\btests? (?:check|checks|keep|keeps|show|shows)\b|\bCI (?:executes|runs)\b",
    re.IGNORECASE,
)
TEST_PATH = re.compile(r"tests/[\w/.-]*\w")
TEST_FUNCTION = re.compile(r"`(test_\w+)`")
LINK = re.compile(r"\]\(([^)\s]*)\)")


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def _units(text: str) -> list[str]:
    """The paragraphs, list items and table rows of a Markdown text, code blocks left out."""
    units: list[str] = []
    for block in re.split(r"\n\s*\n", _prose(text)):
        lines = [line for line in block.splitlines() if not line.startswith("#")]
        if lines and all(line.startswith("|") for line in lines):
            units += lines
            continue
        item: list[str] = []
        for line in lines:
            if re.match(r"(- |\d+\. )", line) and item:
                units.append("\n".join(item))
                item = []
            item.append(line)
        if item:
            units.append("\n".join(item))
    return units


def _defined_tests() -> set[str]:
    return {
        name
        for path in TESTS.rglob("test_*.py")
        for name in re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), flags=re.M)
    }


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _table(text: str, header: str) -> str:
    start = text.index(header)
    return text[start:].split("\n\n", 1)[0]


def test_ci_runs_the_readme_test_command():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    install, test = (block.strip() for block in _bash_blocks(quickstart)[:2])
    assert install.endswith("raytrain train")
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines()
    assert "torch==2.13.0" in install and "torch==2.13.0" in ci
    assert ci.index("torch==2.13.0") < ci.index('-e ".[dev]"')  # torch before the project


def test_the_config_reference_page_is_the_schema():
    page = (DOCS / "users" / "configuration.md").read_text()
    table = page.split("<!-- config-reference:start -->\n", 1)[1].split(
        "<!-- config-reference:end -->", 1
    )[0]
    assert table.strip() == config_reference_markdown().strip()


def test_the_readme_and_the_commands_page_show_the_same_commands():
    page = (DOCS / "users" / "commands.md").read_text()
    header = "| command | does |"
    assert _table(README, header) == _table(page, header)


def test_the_readme_stays_a_front_page():
    assert len(README.splitlines()) <= 250


@pytest.mark.parametrize("document", DOCUMENTS, ids=IDS)
def test_every_test_a_page_names_exists(document: Path):
    text = document.read_text()
    assert [path for path in TEST_PATH.findall(text) if not (ROOT / path).exists()] == []
    defined = _defined_tests()
    assert [name for name in TEST_FUNCTION.findall(text) if name not in defined] == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=IDS)
def test_every_claim_names_its_test(document: Path):
    unnamed = [
        unit
        for unit in _units(document.read_text())
        if CLAIM.search(" ".join(unit.split()))
        and not (TEST_PATH.search(unit) or TEST_FUNCTION.search(unit))
    ]
    assert unnamed == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=IDS)
def test_every_relative_link_leads_to_a_file(document: Path):
    """The README may link anywhere in the repository; a page of docs/ only inside docs/,
    which is all the site holds (name a file outside it as plain text)."""
    root = ROOT if document == README_PATH else DOCS
    broken = []
    for target in LINK.findall(_prose(document.read_text())):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):  # an anchor, or a URL
            continue
        resolved = (document.parent / path).resolve()
        if not resolved.exists() or not resolved.is_relative_to(root):
            broken.append(target)
    assert broken == []


def test_every_page_is_in_the_site_nav():
    """MkDocs reports a page missing from the nav only as information, even when strict."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True
    nav = _nav_pages(config["nav"])
    assert sorted(nav) == sorted(str(page.relative_to(DOCS)) for page in PAGES)
    assert len(nav) == len(set(nav))


def test_the_site_builds_strictly(tmp_path):
    """No broken link or anchor, no missing page: what ``mkdocs build --strict`` refuses."""
    site = tmp_path / "site"
    # Not --quiet: it hides the warnings that --strict counts, and the build passes.
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    build = subprocess.run(
        [*command, "--config-file", str(ROOT / "mkdocs.yml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    assert (site / "index.html").exists()
