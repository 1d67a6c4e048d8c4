"""Render the parts of the docs that come from the code (today: the lifecycle tables in
docs/architecture.md, between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` markers).

    python scripts/render_docs.py          # rewrite the blocks
    python scripts/render_docs.py --check  # exit 1 if a block differs from the code

``tests/test_architecture.py`` runs the check.
"""

from __future__ import annotations

import pathlib
import re
import sys
from collections.abc import Callable

from kvbudget.core.lifecycle import outcome_table_markdown, transition_table_markdown

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "transitions": ("docs/architecture.md", transition_table_markdown),
    "outcomes": ("docs/architecture.md", outcome_table_markdown),
}


def block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- BEGIN {name} -->\n)(.*?)(<!-- END {name} -->)", flags=re.DOTALL
    )


def render(check: bool) -> list[str]:
    """Rewrite (or, with ``check``, compare) every block; returns the names that differed."""
    stale = []
    for name, (path, make) in BLOCKS.items():
        file = ROOT / path
        text = file.read_text()
        pattern = block_pattern(name)
        match = pattern.search(text)
        if match is None:
            raise SystemExit(f"{path}: no <!-- BEGIN {name} --> ... <!-- END {name} --> block")
        if match.group(2) != make():
            stale.append(name)
            if not check:
                text = pattern.sub(lambda m: m.group(1) + make() + m.group(3), text)
                file.write_text(text)
    return stale


if __name__ == "__main__":
    check = "--check" in sys.argv[1:]
    stale = render(check)
    if stale and check:
        print(f"out of date: {', '.join(stale)} (run python scripts/render_docs.py)")
        sys.exit(1)
