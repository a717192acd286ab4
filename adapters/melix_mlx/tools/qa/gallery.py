"""The gallery under the divergence contract: every qa target in every regime that rounds differently.

Rules of this module:
- A script (`python -m melix_mlx.tools.qa.gallery [--models ...] [--regimes ...]
  [--targets ...] [--max-examples N] [--out FILE]`), not a test: each cell is one `melix-fsm qa` process
  (`--json`, seed 1, profile quick), so a cell's time and memory are its own and its
  command is the one the docs print. `--max-examples` bounds the correct targets' rounds
  (benchmarks/gpu.sh, where the device's time is short); the default is the profile's.
- Targets (docs/qa_gallery.md): `mlx-lm` (mlx-lm's own BatchGenerator, the control),
  `melix` (this project's MTPBatchGenerator) and `planted`
  (tests/adapters/qa_planted_target.py's `five_bugs`: the five bug classes a public
  fork's batched MTP had, planted at the surface of mlx-lm's BatchGenerator; 3 examples
  per round and 300 draws, as its CI test, since finding them is what it is for).
- Regimes: `bfloat16` (model and head cast, judged in bfloat16), `q4` (`melix-fsm convert
  -q`, group 64, built once per checkpoint under `--work`; judged in the logits' dtype,
  float32) and `simulated` (float32 weights under `--simulate-rounding bfloat16`: every
  forward other than one row of one token carries up to 3 bfloat16 ulps of noise, judged
  in bfloat16).
- A cell passes when a correct target reports no bug (its near-ties counted) and the
  planted target reports every one of its five classes, each wrong token judged a bug.
  The exit status is 0 when every cell passes.
- Output: one line per cell as it ends, then a markdown table; `--out` gets the JSON
  (each cell's command, exit code, time, divergence ledger and bug signatures),
  rewritten after every cell so a cut run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[4]
PLANTED_DIR = ROOT / "tests" / "adapters"
TARGETS = {"mlx-lm": "mlx-lm", "melix": "melix", "planted": "qa_planted_target:five_bugs"}
REGIMES = ("bfloat16", "q4", "simulated")
MODELS = ("stdlib-tiny", "stdlib-hybrid")
PLANTED = {
    "generator_raised:IndexError@qa_planted_target.py:_prepare_next_step",
    "generator_raised:KeyError@qa_planted_target.py:_drop_pending",
    "tokens_match_reference:-@later token, joined running batch",
    "tokens_match_reference:-@first token, ragged insert",
    "generator_raised:TypeError@qa_planted_target.py:filter",
}


def quantized(model: str, work: Path) -> str:
    out = work / f"{model}-q4"
    if not (out / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "melix_fsm.cli", "convert", "-q", model, str(out)],
            check=True,
            capture_output=True,
        )
    return str(out)


def command(target: str, model: str, regime: str, work: Path, seed: int, examples: int | None) -> list[str]:
    args = ["melix-fsm", "qa", TARGETS[target], "--seed", str(seed), "--json", "--quiet"]
    if regime == "bfloat16":
        args += ["--model", model, "--dtype", "bfloat16"]
    elif regime == "q4":
        args += ["--model", quantized(model, work)]
    else:
        args += ["--model", model, "--simulate-rounding", "bfloat16"]
    if target == "planted":
        args += ["--max-examples", "3", "--draws", "300"]
    elif examples is not None:
        args += ["--max-examples", str(examples)]
    return args


def run_cell(
    target: str, model: str, regime: str, work: Path, seed: int, examples: int | None = None
) -> dict[str, Any]:
    args = command(target, model, regime, work, seed, examples)
    env = dict(os.environ)
    if target == "planted":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLANTED_DIR), env.get("PYTHONPATH")]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    tic = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "melix_fsm.cli", *args[1:]], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - tic
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cell: dict[str, Any] = {
        "target": target,
        "model": model,
        "regime": regime,
        "command": " ".join(args) if target != "planted" else "PYTHONPATH=tests/adapters " + " ".join(args),
        "exit": done.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
    }
    try:
        report = json.loads(done.stdout)
    except ValueError:
        cell["error"] = (done.stderr or done.stdout).strip().splitlines()[-1:]
        cell["ok"] = False
        return cell
    div = report.get("divergence", {})
    bugs = report.get("bugs", [])
    wrong = [b for b in bugs if b.get("property") == "tokens_match_reference"]
    cell.update(
        {
            "verdict": report.get("verdict"),
            "tokens_compared": div.get("tokens_compared", 0),
            "divergences": div.get("divergences", 0),
            "near_ties": div.get("near_ties", 0),
            "judged_bugs": div.get("bugs", 0),
            "per_1000": div.get("per_1000_tokens", {}).get("all", 0.0),
            "histogram": div.get("histogram", []),
            "contract": div.get("contract"),
            "bugs": sorted(b["signature"] for b in bugs),
            "wrong_token_gaps_ulps": [(b.get("divergence") or {}).get("gap_ulps") for b in wrong],
            "distribution": distribution(report),
        }
    )
    if target == "planted":
        gaps = cell["wrong_token_gaps_ulps"]
        cell["ok"] = set(cell["bugs"]) >= PLANTED and all(g is not None and g > 8 for g in gaps)
    else:
        cell["ok"] = done.returncode == 0 and not bugs
    return cell


def distribution(report: dict[str, Any]) -> str:
    """The distribution property's outcome in a few words (qa's report has no field for it)."""
    if report.get("distribution") is None or report.get("distribution_note"):
        return report.get("distribution_note") or "not run"
    if any("distribution" in b.get("property", "") for b in report.get("bugs", [])):
        return "FAIL"
    d = report["distribution"]
    p = min((min(q["p_value"], q["z_p_value"]) for q in d["positions"]), default=1.0)
    return f"pass, {d['draws']} draws (smallest p {p:.2g})"


def table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| target | checkpoint | regime | exit | bugs found | tokens compared | near-ties | per 1,000 "
        "| wrong-token gaps (ulps) | distribution | result | wall (CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        if "error" in c:
            lines.append(
                f"| {c['target']} | {c['model']} | {c['regime']} | {c['exit']} | error: {c['error']} |"
            )
            continue
        found = len(c["bugs"]) if c["target"] != "planted" else f"{len(set(c['bugs']) & PLANTED)} of 5"
        gaps = ", ".join(f"{g:.3g}" for g in c["wrong_token_gaps_ulps"] if g is not None) or "-"
        head = f"| {c['target']} | {c['model']} | {c['regime']} | {c['exit']} | {found} "
        lines.append(
            f"{head}| {c['tokens_compared']} | {c['near_ties']} | {c['per_1000']:.3g} | {gaps} "
            f"| {c['distribution']} | {'pass' if c['ok'] else 'FAIL'} "
            f"| {c['wall_s']:.0f}s ({c['cpu_s']:.0f}s) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-examples", type=int, default=None, metavar="N")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "qa-gallery")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    cells: list[dict[str, Any]] = []
    started = datetime.now(UTC).isoformat(timespec="seconds")
    for model in args.models:
        for regime in args.regimes:
            for target in args.targets:
                cell = run_cell(target, model, regime, args.work, args.seed, args.max_examples)
                cells.append(cell)
                print(
                    f"{target:8s} {model:14s} {regime:9s} exit {cell['exit']} "
                    f"{'pass' if cell['ok'] else 'FAIL'} {cell.get('near_ties', '-')} near-tie(s) in "
                    f"{cell.get('tokens_compared', '-')} tokens, bugs {cell.get('bugs', cell.get('error'))} "
                    f"({cell['wall_s']:.0f}s)",
                    flush=True,
                )
                if args.out is not None:
                    doc = {"started": started, "seed": args.seed, "cells": cells}
                    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(cells))
    return 0 if all(c["ok"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
