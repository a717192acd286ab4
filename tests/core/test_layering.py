"""The architecture's two rules that a reader cannot see from one file.

- The core (melix_fsm) never imports the mlx adapter (melix_mlx), by statement or by name
  string: commands and kit defaults reach it through entry points, so the dependency
  points from the adapter to the core.
- Every exception class the package defines derives from MelixError (one clause catches
  them all); private control-flow exceptions (a leading underscore) are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import melix_fsm

CORE = Path(melix_fsm.__file__).parent
ADAPTERS = CORE.parent / "adapters" / "melix_mlx"


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_core_names_no_adapter_module() -> None:
    offenders = []
    for path in _modules(CORE):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                value = node.args[0].value  # importlib.import_module("melix_mlx...") and the like
                names = [value] if isinstance(value, str) else []
            where = f"{path.relative_to(CORE)}:{getattr(node, 'lineno', '?')}"
            offenders += [f"{where} {n}" for n in names if n.startswith("melix_mlx")]
    assert offenders == []


def test_every_public_exception_is_a_melix_error() -> None:
    import importlib
    import inspect

    from melix_fsm.errors import MelixError

    roots = [(CORE, "melix_fsm")] + ([(ADAPTERS, "melix_mlx")] if ADAPTERS.is_dir() else [])
    outside = []
    for root, package in roots:
        for path in _modules(root):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            tree = ast.parse(path.read_text())
            defined = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name[0] != "_"]
            if not defined:
                continue
            try:
                module = importlib.import_module(".".join([package, *parts]))
            except ImportError:  # the adapter's modules need mlx; the core's test run may lack it
                continue
            for name in defined:
                cls = getattr(module, name)
                is_error = inspect.isclass(cls) and issubclass(cls, BaseException)
                if is_error and not issubclass(cls, MelixError):
                    outside.append(f"{package}.{'.'.join(parts)}.{name}")
    assert outside == []
