"""What a response may say about the host: nothing.

Rules: the model is named by its served name, never its path; a receipt or setting that
holds a path gives its base name only; the system fingerprint names this package's
version, not the kernel or libc.
"""

from __future__ import annotations

import os
import re
from typing import Any

from melix_fsm import __version__ as VERSION

FINGERPRINT = f"melix-fsm-{VERSION}"
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)+([\w.+-]+)")  # an absolute path of 2+ parts


def redact(text: str) -> str:
    """`text` (an exception's message) with every absolute path reduced to its base name."""
    return _PATH.sub(lambda m: m.group(1), text)


def served_name(path: Any, given: str | None = None) -> str:
    """The name the model is served under: `given`, else its directory's base name."""
    return given or os.path.basename(os.path.normpath(str(path))) or "model"


def scrub(value: Any, replacements: dict[str, str]) -> Any:
    """`value` with every path-like string reduced (see the rules); containers copied."""
    if isinstance(value, dict):
        return {k: scrub(v, replacements) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v, replacements) for v in value]
    if isinstance(value, str):
        for old, new in replacements.items():
            if old and old in value:
                value = value.replace(old, new)
        if os.path.isabs(value) and "\n" not in value:
            return os.path.basename(os.path.normpath(value))
        return redact(value)  # a path inside a message
    return value
