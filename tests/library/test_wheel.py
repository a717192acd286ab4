"""The distribution as a user gets it: built, installed outside the checkout, run.

`python -m build` makes the sdist and the wheel from it; the wheel must hold both
packages with their `py.typed`, the spec files the core reads at run time
(melix_fsm/_spec: the machines, the registry, the receipt and statistics schemas) and
the embedded checkpoints, and stay under WHEEL_LIMIT_MB. It is installed (with the mlx
extra) into a fresh virtual environment outside the checkout, and from another directory
the README's library example and `melix-fsm generate --json` run and import the
installed packages, never the working tree.

Slow (a build, a fresh environment and its dependencies: minutes): `pytest -m slow
tests/library/test_wheel.py`; CI runs it as its own step (.ci/run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEEL_LIMIT_MB = 40  # today ~35 MB, nearly all of it the three embedded checkpoints
SPEC_FILES = [p.name for p in sorted((ROOT / "spec").iterdir()) if p.suffix in (".toml", ".json")]
ASSETS = ["stdlib-tiny", "stdlib-hybrid", "stdlib-tiny-draft"]

pytestmark = pytest.mark.slow


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- readme-test: run -->\n```python\n(.*?)```", text, re.S)
    assert match, "README.md has a library example marked `readme-test: run`"
    return match.group(1)


def _clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["MELIX_FSM_CALIBRATION_CACHE"] = str(tmp / "calibration")
    env["MELIX_FSM_CACHE"] = str(tmp / "cache")
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_the_wheel_installed_outside_the_checkout_runs_the_readme(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], tmp_path, dict(os.environ))
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1
    wheel = wheels[0]
    size_mb = wheel.stat().st_size / 2**20
    assert size_mb < WHEEL_LIMIT_MB, f"the wheel is {size_mb:.1f} MB, over the {WHEEL_LIMIT_MB} MB bound"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"melix_fsm/py.typed", "melix_mlx/py.typed"} <= names
    assert {f"melix_fsm/_spec/{f}" for f in SPEC_FILES} <= names, "spec files missing from the wheel"
    for asset in ASSETS:
        assert f"melix_mlx/assets/{asset}/config.json" in names
        assert any(n.startswith(f"melix_mlx/assets/{asset}/") and n.endswith(".safetensors") for n in names)

    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _clean_env(tmp_path)
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python, cli = venv / "bin" / "python", venv / "bin" / "melix-fsm"
    _run([str(python), "-m", "pip", "install", "-q", f"{wheel}[mlx]"], elsewhere, env, timeout=1800)

    where = _run(
        [str(python), "-c", "import melix_fsm, melix_mlx; print(melix_fsm.__file__, melix_mlx.__file__)"],
        elsewhere,
        env,
    )
    assert str(ROOT) not in where and str(venv) in where, where
    out = _run([str(python), "-c", _readme_example()], elsewhere, env)
    assert out.strip(), "the README example prints what it generated"
    line = _run(
        [str(cli), "generate", "--prompt", "def parse_args(argv):", "--max-tokens", "8", "--json"],
        elsewhere,
        env,
    )
    result = json.loads(line)
    assert result["model_source"] == "embedded" and len(result["tokens"]) == 8
    assert result["receipt"]["schema"].startswith("melix-fsm/receipt/")
    assert result["stats"]["schema"].startswith("melix-fsm/stats/")
