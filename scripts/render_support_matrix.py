#!/usr/bin/env python3
"""Rewrite the cell tables of docs/support-matrix.md from the engine profiles' support tables
(adapters/<engine>/profile.py).

    PYTHONPATH=. python scripts/render_support_matrix.py

tests/unit/test_support_matrix.py fails while the page and the tables disagree.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.profiles import SUPPORT_ENGINES  # noqa: E402
from app.services.planning import support_matrix_rows  # noqa: E402


def render(text: str) -> str:
    """The page with each `### Cells: ENGINE` table's rows replaced by the generated ones."""
    for engine in SUPPORT_ENGINES:
        head, sep, rest = text.partition(f"\n### Cells: {engine}\n")
        if not sep:
            raise SystemExit(f"docs/support-matrix.md has no '### Cells: {engine}' section")
        lines = rest.split("\n")
        start = next(i for i, line in enumerate(lines) if line.startswith("|---")) + 1
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("| ")), len(lines))
        text = head + sep + "\n".join([*lines[:start], *support_matrix_rows(engine), *lines[end:]])
    return text


if __name__ == "__main__":
    page = ROOT / "docs" / "support-matrix.md"
    page.write_text(render(page.read_text()))
