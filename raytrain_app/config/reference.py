"""The README's config reference, generated from the schema so the two never drift.

``python -m raytrain_app.config.reference`` prints the Markdown table; a unit test checks
that the README holds exactly this table.
"""

from __future__ import annotations

import json

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raytrain_app.config import RaytrainConfig


def _rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _rows(annotation, f"{prefix}{name}.")
            continue
        default = field.default_factory() if field.default is PydanticUndefined else field.default
        rows.append((f"{prefix}{name}", json.dumps(default), field.description or ""))
    return rows


def config_reference_markdown() -> str:
    """Every config key with its default and meaning, as a Markdown table."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [
        f"| `{key}` | `{default}` | {meaning} |" for key, default, meaning in _rows(RaytrainConfig)
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference_markdown())
