"""Two revisions of this project side by side: `melix-fsm bench` run alternately from two
checkouts (A B A B ...) on the same machine, each cell's ratio to mlx-lm taken inside its
own run (so both sides are normalised by the same process's plain baseline).

Usage (OpenBLAS regime, both embedded checkpoints, batch 1/4/8, k 1/2):

    python benchmarks/compare_revisions.py BASE_CHECKOUT HEAD_CHECKOUT --rounds 2 \
        --out benchmarks/results/compare.json -- --regime openblas --max-tokens 64 --repeats 2

Each checkout is put first on PYTHONPATH (its `melix_fsm` and `adapters/`), the
interpreter and mlx are this environment's. Reported per cell: median ratio of each side,
their quotient (head / base) and the spread over rounds; the A/A spread the bench measures
inside each run says how far this machine moves a ratio by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = ("stdlib-tiny", "stdlib-hybrid")


def run_bench(checkout: Path, model: str, extra: list[str]) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(checkout / "adapters")])
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "melix_fsm.cli", "bench", "--model", model, "--out", out, *extra]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        cells: list[dict] = []
        for path in sorted(Path(out).rglob("*.json")):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and "cells" in data:
                cells += data["cells"]
        return cells


def key(cell: dict) -> str:
    return f"{cell['path']} B={cell['batch_size']} k={cell['k']} T={cell['temp']}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("base", type=Path)
    parser.add_argument("head", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    extra = argv[cut + 1 :]  # after --: passed to melix-fsm bench
    ratios: dict[str, dict[str, list[float]]] = {}
    spreads: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for model in args.models:
            for side, checkout in (("base", args.base), ("head", args.head)):
                print(f"round {r + 1}/{args.rounds}: {model} {side}", file=sys.stderr, flush=True)
                for cell in run_bench(checkout, model, extra):
                    name = f"{model} {key(cell)}"
                    ratios.setdefault(name, {"base": [], "head": []})[side].append(cell["ratio"])
                    if cell.get("ratio_min") is not None:
                        spreads.setdefault(name, []).append(cell["ratio_max"] / cell["ratio_min"])
    table = {}
    for name, sides in ratios.items():
        base, head = statistics.median(sides["base"]), statistics.median(sides["head"])
        table[name] = {
            "base": sides["base"],
            "head": sides["head"],
            "head_over_base": head / base,
            "within_run_spread": statistics.median(spreads.get(name, [float("nan")])),
        }
        print(f"{name:45s} base {base:.3f} head {head:.3f} head/base {head / base:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "bench_args": extra, "cells": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
