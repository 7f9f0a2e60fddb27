"""The configuration reference (docs/users/configuration.md), generated from the schema so
the two never drift.

``python -m raytrain_app.config.reference docs/users/configuration.md`` rewrites the table
between the page's markers; without a path it prints the table. A unit test checks that the
page holds exactly this table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raytrain_app.config import RaytrainConfig

START = "<!-- config-reference:start -->\n"
END = "<!-- config-reference:end -->"


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


def write_config_reference(page: Path) -> None:
    """Replace the table between ``page``'s markers with the schema's."""
    text = page.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{page} has no {START.strip()} ... {END} markers")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    page.write_text(f"{before}{START}{config_reference_markdown()}\n{END}{after}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        write_config_reference(Path(sys.argv[1]))
    else:
        print(config_reference_markdown())
