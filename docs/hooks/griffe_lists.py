"""A griffe extension for the API reference: docstring lists render as lists.

The project's docstrings write "Rules of this module:" followed at once by "- ..." items,
as plain text reads best; Markdown needs a blank line before a list, so one is added
(the docstrings in the source stay as they are).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ITEM = re.compile(r"^(?:[-*]|\d+\.) ")


def spaced(text: str) -> str:
    """`text` with a blank line before each list that follows a paragraph line directly."""
    out: list[str] = []
    in_list = False
    for line in text.splitlines():
        if _ITEM.match(line):
            if not in_list and out and out[-1].strip():
                out.append("")
            in_list = True
        elif not line.strip():
            in_list = False
        out.append(line)
    return "\n".join(out)


class BlankLineBeforeLists(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = spaced(obj.docstring.value)
