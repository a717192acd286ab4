"""A compact markdown table of `melix-fsm bench` results (the one BENCHMARKS.md and the
README open with): per cell the speedup over mlx-lm's own path, its min-max over the
repeats, the A/A range (how far the machine moves a ratio by itself), the ideal the same
run's calibration allows and the efficiency (speedup / ideal).

    python benchmarks/current_table.py benchmarks/results/<model>/bench-openblas.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    model = Path(data["model"]).name
    regime = data["regime"].get("blas", "?")
    out = []
    for c in data["cells"]:
        where = "single-sequence" if c["path"] == "single" else f"batch {c['batch_size']}"
        aa = c.get("aa_ratios") or []
        aa_text = f"{min(aa):.2f}-{max(aa):.2f}" if aa else "-"
        ideal = c.get("ideal_ratio")
        eff = c.get("efficiency")
        out.append(
            f"| {model} | {regime} | {where} | {c['k']} | **{c['ratio']:.2f}x** "
            f"({c['ratio_min']:.2f}-{c['ratio_max']:.2f}) | {aa_text} | "
            f"{ideal:.2f} | {eff:.2f} |"
            if ideal is not None and eff is not None
            else f"| {model} | {regime} | {where} | {c['k']} | **{c['ratio']:.2f}x** "
            f"({c['ratio_min']:.2f}-{c['ratio_max']:.2f}) | {aa_text} | - | - |"
        )
    return out


def main() -> int:
    print("| model | BLAS | cell | k | MTP / mlx-lm (min-max) | A/A | ideal | efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        print("\n".join(rows(Path(arg))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
