"""Where commands write when the user names no directory.

Rules of this module:
- Output a user did not ask for a place for goes to the cache directory, never into the
  working directory (which is often a source tree): $MELIX_FSM_CACHE, else
  $XDG_CACHE_HOME/melix-fsm, else ~/.cache/melix-fsm.
- Commands print the directory they wrote to, so the files are found without reading this.
- No mlx import.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MELIX_FSM_CACHE"


def cache_dir() -> Path:
    """The melix-fsm cache directory (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "melix-fsm"


def default_output(name: str) -> Path:
    """The directory a command writes `name` output to when given no --out."""
    return cache_dir() / name
