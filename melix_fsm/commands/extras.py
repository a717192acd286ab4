"""Optional dependencies of a command, checked before it runs.

Rules of this module:
- A command needs modules that only an extra of the melix-fsm distribution installs
  (`mlx`, `serve`, `bench`). Each requirement is a (module, extra) pair; `missing`
  finds the absent modules without importing them (importlib.util.find_spec), so the
  check is cheap and runs before any work.
- `melix_fsm.cli` checks the requirements of the parsed command (a plugin package
  declares them beside its COMMAND_MODULES) and exits 2 with one line per extra to
  install: `melix-fsm bench: needs matplotlib: pip install "melix-fsm[bench]"`.
- No mlx import.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

DISTRIBUTION = "melix-fsm"

Requirement = tuple[str, str]  # (top-level module, extra of DISTRIBUTION that installs it)


def missing(requirements: Iterable[Requirement]) -> list[Requirement]:
    """The requirements whose module cannot be found, in order, without duplicates."""
    out: list[Requirement] = []
    for module, extra in requirements:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken parent package, or a module set to None
            found = False
        if not found and (module, extra) not in out:
            out.append((module, extra))
    return out


def install_hint(extras: Iterable[str]) -> str:
    """`pip install "melix-fsm[a,b]"` for these extras (in order, without duplicates)."""
    names = list(dict.fromkeys(extras))
    return f'pip install "{DISTRIBUTION}[{",".join(names)}]"'


def messages(prog: str, absent: Iterable[Requirement]) -> list[str]:
    """One line per extra to install, naming its missing modules."""
    by_extra: dict[str, list[str]] = {}
    for module, extra in absent:
        by_extra.setdefault(extra, []).append(module)
    return [f"{prog}: needs {', '.join(mods)}: {install_hint([extra])}" for extra, mods in by_extra.items()]
