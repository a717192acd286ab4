"""The architecture's rules that a reader cannot see from one file.

- The core (melix_fsm) never imports the mlx adapter (melix_mlx), by statement or by name
  string: commands and kit defaults reach it through entry points, so the dependency
  points from the adapter to the core.
- Every exception class the package defines derives from MelixError (one clause catches
  them all); private control-flow exceptions (a leading underscore) are exempt.
- No import circle between modules, function-level imports included (they hide a circle
  from the interpreter, not from a reader), and no module takes another's private names.
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


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _imports(path: Path, name: str) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file, at any depth
    (a function-level import hides a circle from the interpreter, not from this test)."""
    out = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, [a.name for a in node.names]))
    return out


def _graph() -> dict[str, list[tuple[str, list[str]]]]:
    graph = {}
    for root, package in ((CORE, "melix_fsm"), (ADAPTERS, "melix_mlx")):
        for path in _modules(root):
            graph[_module_name(path, root, package)] = _imports(path, _module_name(path, root, package))
    return graph


def _target(graph: dict, module: str, names: list[str]) -> list[str]:
    """The project modules an import statement reaches (`from pkg import mod` names mod)."""
    hits = [f"{module}.{n}" for n in names if f"{module}.{n}" in graph]
    return hits or ([module] if module in graph else [])


def test_no_import_circle_between_modules() -> None:
    graph = _graph()
    edges = {
        m: {t for mod, names in imps for t in _target(graph, mod, names) if t != m}
        for m, imps in graph.items()
    }
    # a package's __init__ re-exporting its own modules is not a circle of concerns
    edges = {
        m: {t for t in ts if not m.startswith(t + ".") and not t.startswith(m + ".")}
        for m, ts in edges.items()
    }
    circles = set()
    for start in edges:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    circles.add(" -> ".join(sorted(path)))
                elif nxt not in path and len(path) < 6:
                    stack.append((nxt, [*path, nxt]))
    assert sorted(circles) == []


def test_no_module_imports_another_modules_private_names() -> None:
    graph = _graph()
    offenders = [
        f"{m} takes {n} from {mod}"
        for m, imps in graph.items()
        for mod, names in imps
        if mod in graph and mod != m
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert offenders == []
