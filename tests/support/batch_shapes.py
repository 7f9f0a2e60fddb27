"""Batch types users bring besides tuples of tensors, shared by the unit and GPU tiers."""

from __future__ import annotations

from collections import UserDict
from typing import Any


class Encoding(UserDict):
    """A Hugging Face ``BatchEncoding`` in miniature: a ``UserDict`` with attribute access
    to its keys and state of its own (the fast tokenizer's encodings)."""

    def __init__(self, data: dict | None = None, encodings: list | None = None) -> None:
        super().__init__(data)
        self._encodings = encodings

    def __getattr__(self, item: str) -> Any:
        try:
            return self.data[item]
        except KeyError:
            raise AttributeError(item) from None

    def word_ids(self, index: int = 0) -> list:
        return self._encodings[index]
