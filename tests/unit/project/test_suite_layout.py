"""The suite itself: pytest imports test modules by basename, so two test files with one
name in different tiers make the whole run fail at collection."""

from __future__ import annotations

from collections import Counter

from paths import TESTS


def test_test_module_names_are_unique_across_tiers():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    assert [name for name, count in names.items() if count > 1] == []
