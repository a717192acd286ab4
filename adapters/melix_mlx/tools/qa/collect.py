"""One file for an exactness run on a device: every verify report and gallery cell, summarised.

Rules of this module:
- `python -m melix_mlx.tools.qa.collect RESULTS` reads RESULTS/device.json (what mlx saw:
  version, default device, CUDA), RESULTS/verify/*.json (`melix-fsm verify --out`) and
  RESULTS/gallery.json (melix_mlx.tools.qa.gallery --out), writes RESULTS/exactness.json
  and prints one line per run (benchmarks/gpu.sh's exactness part).
- Each verify entry keeps the verdict, the identity (bit-exact / within contract / FAIL),
  the promise, the divergence ledger (tokens, near-ties, bugs, rate per 1,000, histogram,
  the first records with their margins) and each part's result; the gallery cells are
  kept as they are. A missing or unreadable file is recorded as such, never skipped.
- Exit status: 0 when every verify passed and every gallery cell passed, 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"unreadable": f"{path.name}: {type(exc).__name__}: {exc}"}


def verify_entry(report: dict[str, Any]) -> dict[str, Any]:
    if "unreadable" in report:
        return {"verdict": "missing", **report}
    d = report.get("divergence", {})
    return {
        "verdict": report["verdict"],
        "identity": report["identity"],
        "promise": report["promise"],
        "tokens_compared": d.get("tokens_compared"),
        "near_ties": d.get("near_ties"),
        "bugs": d.get("bugs"),
        "per_1000": d.get("per_1000_tokens"),
        "histogram": d.get("histogram"),
        "records": d.get("records"),
        "parts": {name: part["result"] for name, part in report["parts"].items()},
        "seconds": round(sum(part["seconds"] for part in report["parts"].values()), 1),
        "settings": report["settings"],
    }


def collect(results: Path) -> tuple[dict[str, Any], list[str], bool]:
    out: dict[str, Any] = {"device": _read(results / "device.json"), "verify": {}, "gallery": None}
    for path in sorted((results / "verify").glob("*.json")):
        out["verify"][path.stem] = verify_entry(_read(path))
    gallery = results / "gallery.json"
    if gallery.exists():
        out["gallery"] = _read(gallery).get("cells", [])
    lines = []
    for name, v in out["verify"].items():
        lines.append(
            f"verify {name}: {v['verdict']}, {v.get('identity')}, {v.get('near_ties')} near-tie(s) / "
            f"{v.get('bugs')} bug(s) in {v.get('tokens_compared')} tokens"
        )
    for c in out["gallery"] or []:
        lines.append(
            f"gallery {c['target']} {c['model']} {c['regime']}: {'pass' if c.get('ok') else 'FAIL'}, "
            f"{c.get('near_ties')} near-tie(s) in {c.get('tokens_compared')} tokens, bugs {c.get('bugs')}"
        )
    ok = bool(out["verify"]) and all(v["verdict"] == "pass" for v in out["verify"].values())
    ok = ok and all(c.get("ok") for c in out["gallery"] or [])
    return out, lines, ok


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m melix_mlx.tools.qa.collect RESULTS_DIR", file=sys.stderr)
        return 2
    results = Path(args[0])
    out, lines, ok = collect(results)
    (results / "exactness.json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
