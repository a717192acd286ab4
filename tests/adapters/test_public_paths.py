"""The import paths people embed keep working after the layout moved into wings.

`melix_mlx.generate`, `melix_mlx.batch_generator` and `melix_mlx.decode` re-export the
decoding wing's modules (the same objects, not copies); `melix_mlx.loading` is the loading
wing itself and re-exports its loaders.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "melix_mlx.generate": ("melix_mlx.decoding.generate", ["mtp_stream_generate", "mtp_generate_step"]),
    "melix_mlx.batch_generator": ("melix_mlx.decoding.batch_generator", ["MTPBatchGenerator", "MTPResponse"]),
    "melix_mlx.decode": ("melix_mlx.decoding.decode", ["MTPDecoder"]),
    "melix_mlx.loading": ("melix_mlx.loading.loaders", ["load_with_heads", "load_main", "HeadInfo"]),
}


@pytest.mark.parametrize("public", sorted(PUBLIC))
def test_a_public_path_re_exports_the_same_objects(public: str) -> None:
    home, names = PUBLIC[public]
    shown, origin = importlib.import_module(public), importlib.import_module(home)
    for name in names:
        assert getattr(shown, name) is getattr(origin, name)
    # everything the public path exports is its home's own public surface
    assert set(shown.__all__) <= {n for n in dir(origin) if not n.startswith("_")}


def test_every_module_imports_first() -> None:
    """Each module imports in a fresh interpreter state of the package: an import circle
    through a package's `__init__` fails only for some import orders, so every module is
    tried first once (melix_mlx's modules are dropped from sys.modules before each)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(importlib.import_module("melix_mlx").__file__).parent
    names = sorted(
        ".".join(("melix_mlx", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for p in root.rglob("*.py")
        if "__pycache__" not in p.parts
    )
    script = (
        "import importlib, sys\n"
        f"failed = []\nfor name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m == 'melix_mlx' or m.startswith('melix_mlx.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as exc:\n        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""
