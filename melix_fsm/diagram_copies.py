"""Copies of the generated diagrams inside hand-written pages (README.md, docs/*.md).

A page embeds a machine's Mermaid diagram between two marker lines:

    <!-- melix-fsm diagram: controller.mmd -->
    ```mermaid
    ...generated...
    ```
    <!-- /melix-fsm diagram -->

`melix-fsm diagram` rewrites the block from the spec and `melix-fsm diagram --check`
fails on a stale one, like the files in spec/diagrams/: no copy can drift from the spec.

Rules of this module:
- Only a source checkout has pages (the spec folder's parent holds README.md); an
  installed package has none, and the check then covers spec/diagrams/ alone.
- Any file name `melix_fsm.diagrams.TEXT_RENDERERS` knows may be embedded; an unknown
  name or an unclosed block is a SpecError naming the page and line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from .errors import SpecError

_OPEN = re.compile(r"^<!-- melix-fsm diagram: (?P<name>[\w.]+) -->$")
_CLOSE = "<!-- /melix-fsm diagram -->"


def pages(root: Path) -> list[Path]:
    """The hand-written pages of a source checkout that may embed diagrams."""
    found = [root / "README.md", *sorted((root / "docs").glob("**/*.md"))]
    return [p for p in found if p.is_file()]


def refresh(text: str, render: Callable[[str], str | None], page: str = "<page>") -> str:
    """`text` with every embedded block regenerated (`render(name)` gives the Mermaid)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _OPEN.match(lines[i])
        out.append(lines[i])
        i += 1
        if match is None:
            continue
        name = match["name"]
        mermaid = render(name)
        if mermaid is None:
            raise SpecError(page, f"line {i}", f"embeds unknown diagram {name!r}")
        end = next((j for j in range(i, len(lines)) if lines[j] == _CLOSE), None)
        if end is None:
            raise SpecError(page, f"line {i}", f"diagram block {name!r} is not closed by {_CLOSE}")
        out += ["```mermaid", *mermaid.rstrip("\n").split("\n"), "```", _CLOSE]
        i = end + 1
    return "\n".join(out)


def stale_pages(root: Path, render: Callable[[str], str | None]) -> list[Path]:
    """Pages whose embedded diagrams differ from the spec's."""
    return [p for p in pages(root) if refresh(p.read_text(encoding="utf-8"), render, str(p)) != p.read_text()]


def write_pages(root: Path, render: Callable[[str], str | None]) -> list[Path]:
    """Regenerate every embedded block; the pages that changed."""
    changed = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        fresh = refresh(text, render, str(page))
        if fresh != text:
            page.write_text(fresh, encoding="utf-8")
            changed.append(page)
    return changed
