"""Where the repository's parts are, for tests wherever they sit in the tree."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
EXAMPLES = ROOT / "examples"
# Test workloads, importable by module name as a user's package would be.
TEST_WORKLOADS = TESTS / "support" / "workloads"
