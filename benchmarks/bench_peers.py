"""Peers on the same checkpoint: a peer's MTP decoding beside this project's and mlx-lm's,
interleaved in one run (greedy, held-out prompts, decode tokens/s, identity to mlx-lm).

Usage:
    python benchmarks/bench_peers.py --peer NAME=CHECKOUT [--peer ...]
        [--model stdlib-hybrid-wide] [--batch-sizes 1 4] [--ks 2] [--rounds 3]
        [--max-tokens 48] [--regime openblas|reference|current] [--out FILE]

Each CHECKOUT is a peer's source tree that the user fetched (its `mlx_lm` package at the
top); this repository never vendors peer code. For example, the AirRunner mlx-lm fork:

    git clone https://github.com/AirRunner/mlx-lm /tmp/airrunner-native
    git -C /tmp/airrunner-native checkout feat/mtp-native    # single-sequence MTP
    git clone https://github.com/AirRunner/mlx-lm /tmp/airrunner-batched
    git -C /tmp/airrunner-batched checkout feat/mtp-batched  # batched MTP as well

Notes on the AirRunner fork (feat/mtp-batched @ dbe8b1b): its batched MTP crashes in
`GenerationBatch.filter` once a row finishes (`_draft_xtc_draws` is None under greedy
sampling; the MTP cache and draft arrays are indexed with an empty list when the last row
ends). The minimal fix applied to the local checkout before measuring (nothing else
changed; no effect on a step that has rows left):

    -            for c in self._mtp_cache:
    -                if hasattr(c, "filter"):
    +            for c in self._mtp_cache:
    +                if hasattr(c, "filter") and keep:
                         c.filter(keep)
    -            if self._draft_toks is not None:
    +            if self._draft_toks is not None and not keep:
    +                self._draft_toks = self._draft_lps = self._draft_accept_lps = None
    +                self._draft_xtc_draws = None
    +            elif self._draft_toks is not None:
                     self._draft_toks = self._draft_toks[keep]
                     ...
    -                self._draft_xtc_draws = [self._draft_xtc_draws[i] for i in keep]
    +                if self._draft_xtc_draws is not None:
    +                    self._draft_xtc_draws = [self._draft_xtc_draws[i] for i in keep]

feat/mtp-native @ f840f6c has no batched MTP (`BatchGenerator` takes no `mtp`): its batch
cells record that error.

How it runs: one worker process per contender (benchmarks/peer_worker.py) loads the
checkpoint once: `melix` (this project and mlx-lm's own paths, from the installed
mlx-lm) and one per peer (the same Python with the peer's checkout first on PYTHONPATH;
`--peer-python` picks another interpreter, e.g. a venv where the peer is installed). Per
round and cell the contenders decode the same prompts one after another, in an order that
rotates every round, so a drifting machine favours nobody. A cell is `single` (one
sequence: `stream_generate` / `mtp_stream_generate` / the peer's `stream_generate(...,
mtp=True)`) or `batch B` (B prompts inserted at once into mlx-lm's `BatchGenerator`,
`MTPBatchGenerator`, the peer's `BatchGenerator(..., mtp=True)`). A method a peer lacks,
or a crash, is recorded as that cell's error, never dropped.

Reported per cell and contender: decode tokens/s (median over runs), the ratio to mlx-lm
in the same round (median, min-max), and identity: runs whose tokens equal mlx-lm's
greedy tokens, with the first differing position where they do not. Results (with each
peer's commit where its checkout says it: a git work tree or a PEER_COMMIT file) are
written as JSON; a markdown table goes to stdout. Re-executes itself in the regime first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adapters"))

from melix_mlx.commands.bench import reexec_in_regime  # noqa: E402

WORKER = Path(__file__).with_name("peer_worker.py")
READY_TIMEOUT_S = 600  # a realistic-size load on a loaded CPU


class Worker:
    """A contender's process: JSON requests in, JSON answers out, one at a time."""

    def __init__(self, name: str, role: str, model: Path, python: str, pythonpath: list[str]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        self.name, self.role = name, role
        self.proc = subprocess.Popen(
            [python, "-u", str(WORKER), role, str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._read()
        if not ready.get("ready"):
            raise SystemExit(f"{name}: worker did not start: {ready}")

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _commit(checkout: Path) -> str | None:
    marker = checkout / "PEER_COMMIT"
    if marker.exists():
        return marker.read_text().strip()
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _contenders(ks: list[int], peers: list[str]) -> list[tuple[str, str, str, int]]:
    """(label, worker, method, k): mlx-lm first (the reference), then ours, then peers."""
    out = [("mlx-lm", "melix", "mlx_lm", 0)]
    out += [(f"melix-fsm k={k}", "melix", "melix", k) for k in ks]
    out += [(name, name, "peer", 0) for name in peers]
    return out


def _summary(runs: list[dict[str, Any]], label: str) -> dict[str, Any]:
    mine = [r for r in runs if r["label"] == label]
    errors = sorted({r["error"] for r in mine if "error" in r})
    ok = [r for r in mine if "error" not in r]
    out: dict[str, Any] = {"runs": len(mine), "errors": errors}
    if not ok:
        return out
    ratios = [r["ratio"] for r in ok if r.get("ratio") is not None]
    out["tokens_per_s"] = statistics.median(r["tps"] for r in ok)
    if ratios:
        out["ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    out["identical"] = sum(1 for r in ok if r["identical"])
    differences = {r["first_difference"] for r in ok if r["first_difference"] is not None}
    out["first_differences"] = sorted(differences)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools.bench_results import regime
    from melix_mlx.tools.workloads import held_out_prompts

    model = resolve_model(args.model)
    texts = [p.text[: args.prompt_chars] if args.prompt_chars else p.text for p in held_out_prompts(model)]
    ours_path = [str(ROOT), str(ROOT / "adapters"), os.environ.get("PYTHONPATH", "")]
    workers = {"melix": Worker("melix", "melix", model, sys.executable, ours_path)}
    peers: dict[str, dict[str, Any]] = {}
    for spec in args.peer:
        name, _, checkout = spec.partition("=")
        workers[name] = Worker(name, "peer", model, args.peer_python or sys.executable, [checkout])
        peers[name] = {"checkout": checkout, "commit": _commit(Path(checkout))}
    prompts = workers["melix"].ask({"method": "encode", "texts": texts})["ids"]
    contenders = _contenders(args.ks, list(peers))
    cells = ["single"] + [f"batch {b}" for b in args.batch_sizes]
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for rnd in range(args.rounds):
        for cell in cells:
            size = 1 if cell == "single" else int(cell.split()[1])
            group = [prompts[(rnd * size + i) % len(prompts)] for i in range(size)]
            order = contenders if rnd % 2 == 0 else list(reversed(contenders))
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            answers = {}
            for label, worker, method, k in order:
                # `single` is the sequence path; `batch B` a generator (B = 1 included)
                req = {"method": method, "prompts": group, "max_tokens": args.max_tokens, "k": k}
                answers[label] = workers[worker].ask(dict(req, batch=cell != "single"))
            reference = answers["mlx-lm"]
            for label, *_ in contenders:
                answer = answers[label]
                record: dict[str, Any] = {"round": rnd, "cell": cell, "label": label}
                if "error" in answer:
                    record["error"] = answer["error"]
                else:
                    tps = answer["decode_tokens"] / max(answer["decode_s"], 1e-9)
                    ref_tps = reference["decode_tokens"] / max(reference["decode_s"], 1e-9)
                    diffs = [_first_difference(a, b) for a, b in zip(answer["tokens"], reference["tokens"])]
                    record.update(tps=tps, ratio=tps / ref_tps if ref_tps else None)
                    record["identical"] = all(d is None for d in diffs)
                    record["first_difference"] = next((d for d in diffs if d is not None), None)
                runs.append(record)
            print(
                f"round {rnd + 1}/{args.rounds} {cell} done at {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    for worker in workers.values():
        worker.close()
    table = {
        cell: {label: _summary([r for r in runs if r["cell"] == cell], label) for label, *_ in contenders}
        for cell in cells
    }
    size_gb = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 1e9
    return {
        "model": str(args.model),
        "model_gb": round(size_gb, 2),
        "regime": regime(),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "prompt_chars": args.prompt_chars,
        "peers": peers,
        "cells": table,
        "runs": runs,
        "wall_s": time.perf_counter() - started,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} ({result['model_gb']} GB), {result['regime']}, greedy, "
        f"{result['max_tokens']} tokens, {result['rounds']} rounds",
        "",
        "| cell | contender | tokens/s | x mlx-lm (min-max) | identical to mlx-lm | note |",
        "|---|---|---|---|---|---|",
    ]
    for cell, row in result["cells"].items():
        for label, s in row.items():
            if "tokens_per_s" not in s:
                lines.append(f"| {cell} | {label} | - | - | - | {'; '.join(s['errors'])[:120]} |")
                continue
            r = s.get("ratio", {})
            spread = f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
            note = "; ".join(s["errors"])[:80]
            if s["first_differences"]:
                note = (note + " " if note else "") + f"first differs at {s['first_differences']}"
            lines.append(
                f"| {cell} | {label} | {s['tokens_per_s']:.2f} | {spread} | "
                f"{s['identical']}/{s['runs']} | {note} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", action="append", default=[], help="NAME=CHECKOUT (repeatable)")
    p.add_argument("--peer-python", default=None, help="interpreter for the peers (default: this one)")
    p.add_argument("--model", default="stdlib-hybrid-wide", help="folder, embedded name or widened preset")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4])
    p.add_argument("--ks", type=int, nargs="+", default=[2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-chars", type=int, default=400, help="cut prompts to N characters (0: whole)")
    p.add_argument("--regime", choices=["openblas", "reference", "current"], default="openblas")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: stdout table only)")
    args = p.parse_args()
    if args.regime != "current":
        reexec_in_regime(args.regime)
    result = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
