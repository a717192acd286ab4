"""Peers on the same checkpoint: a peer's MTP decoding beside this project's and mlx-lm's,
interleaved in one run (greedy, held-out prompts, decode tokens/s, identity to mlx-lm).

Usage:
    python benchmarks/bench_peers.py --peer NAME=CHECKOUT | --peer mlx-vlm [--peer ...]
        [--model stdlib-hybrid-wide] [--batch-sizes 1 4] [--ks 2] [--rounds 3]
        [--max-tokens 48] [--regime openblas|reference|current] [--cells single batch]
        [--ideal] [--profile] [--out FILE]

`--peer mlx-vlm` (no checkout) is the installed mlx-vlm (`pip install 'melix-fsm[vlm]'`):
its MTP speculative decode at each k (`mlx-vlm MTP k=K`: `generate_step` / `BatchGenerator`
with the drafter `load_drafter(MODEL, kind="mtp")` builds from the checkpoint's head,
block size k + 1) and its plain decode (`mlx-vlm plain`), through
melix_mlx.tools.peers_vlm in a worker of its own. Each cell then also reports ours
against mlx-vlm's MTP at the same k: the per-round ratio of tokens/s (median, min-max) and
a verdict: `ahead` when every round is, `behind` when every round is behind, else `level`
(the spread of the rounds covers 1).
`--ideal` calibrates this project's forward times in the same run (after the rounds, at
the cells' context) and reports each speculative contender's ideal bound: B (1 + a) /
(t_verify + k t_head) tokens/s with a its own accepted drafts per row and round, and the
measured share of it. `--profile` puts, per k, the single-sequence cycle of both side by
side (ms per cycle): ours from the engine's cycle clock beside the calibrated verify and
head times; mlx-vlm's from peers_vlm.profile_cycles (each part evaluated before its clock
stops).

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

    def __init__(
        self, name: str, role: str, model: Path, python: str, pythonpath: list[str], clock: str = "wall"
    ) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        self.name, self.role = name, role
        self.proc = subprocess.Popen(
            [python, "-u", str(WORKER), role, str(model), clock],
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


VLM = "mlx-vlm"  # the installed mlx-vlm as a peer (`--peer mlx-vlm`)


def _contenders(ks: list[int], peers: list[str]) -> list[tuple[str, str, str, int]]:
    """(label, worker, method, k): mlx-lm first (the reference), then ours, then peers."""
    out = [("mlx-lm", "melix", "mlx_lm", 0)]
    out += [(f"melix-fsm k={k}", "melix", "melix", k) for k in ks]
    for name in peers:
        if name == VLM:
            out += [(f"mlx-vlm MTP k={k}", VLM, "vlm_mtp", k) for k in ks]
            out.append(("mlx-vlm plain", VLM, "vlm_plain", 0))
        else:
            out.append((name, name, "peer", 0))
    return out


def _head_to_head(runs: list[dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    """Ours over mlx-vlm's MTP at each k, per round of one cell: median, min-max, verdict."""
    out: dict[str, Any] = {}
    for k in ks:
        ours = {r["round"]: r["tps"] for r in runs if r["label"] == f"melix-fsm k={k}" and "tps" in r}
        theirs = {r["round"]: r["tps"] for r in runs if r["label"] == f"mlx-vlm MTP k={k}" and "tps" in r}
        ratios = [ours[n] / theirs[n] for n in ours if n in theirs and theirs[n] > 0]
        if not ratios:
            continue
        lo, hi = min(ratios), max(ratios)
        verdict = "ahead" if lo > 1 else "behind" if hi < 1 else "level"
        out[str(k)] = {"median": statistics.median(ratios), "min": lo, "max": hi, "verdict": verdict}
    return out


def _ideal(summary: dict[str, Any], k: int, size: int, timings: dict[str, Any]) -> None:
    """The contender's ideal bound from this run's calibration and its own acceptance."""
    t = timings.get(str(k), {}).get(str(size))
    if not t or "accepted_mean" not in summary:
        return
    ideal = size * (1 + summary["accepted_mean"]) / ((t["t_verify"] + k * t["t_head"]) / 1e3)
    summary["ideal_tokens_per_s"] = ideal
    summary["of_ideal"] = summary["tokens_per_s"] / ideal


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
    accepted = [r["accepted_mean"] for r in ok if "accepted_mean" in r]
    if accepted:
        out["accepted_mean"] = statistics.median(accepted)
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
    workers = {"melix": Worker("melix", "melix", model, sys.executable, ours_path, args.clock)}
    peers: dict[str, dict[str, Any]] = {}
    for spec in args.peer:
        name, _, checkout = spec.partition("=")
        if name == VLM and not checkout:  # the installed mlx-vlm, through our glue
            from importlib.metadata import version

            workers[name] = Worker(name, VLM, model, sys.executable, ours_path, args.clock)
            peers[name] = {"installed": f"mlx-vlm {version('mlx-vlm')}"}
            continue
        workers[name] = Worker(
            name, "peer", model, args.peer_python or sys.executable, [checkout], args.clock
        )
        peers[name] = {"checkout": checkout, "commit": _commit(Path(checkout))}
    prompts = workers["melix"].ask({"method": "encode", "texts": texts})["ids"]
    contenders = _contenders(args.ks, list(peers))
    cells = (["single"] if "single" in args.cells else []) + (
        [f"batch {b}" for b in args.batch_sizes] if "batch" in args.cells else []
    )
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for cell in cells:  # warm-up, not recorded: first calls build kernels and caches
        size = 1 if cell == "single" else int(cell.split()[1])
        for _, worker, method, k in contenders:
            req = {"method": method, "prompts": prompts[:1] * size, "max_tokens": 8, "k": k}
            workers[worker].ask(dict(req, batch=cell != "single"))
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
                    if "accepted_mean" in answer:
                        record.update(cycles=answer["cycles"], accepted_mean=answer["accepted_mean"])
                    record["identical"] = all(d is None for d in diffs)
                    record["first_difference"] = next((d for d in diffs if d is not None), None)
                runs.append(record)
            print(
                f"round {rnd + 1}/{args.rounds} {cell} done at {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    timings: dict[str, Any] = {}
    if args.ideal:  # after the rounds: the same process, warm, at the cells' context
        sizes = sorted({1, *args.batch_sizes})
        context = max(len(p) for p in prompts) + args.max_tokens // 2
        req = {"method": "calibrate", "ks": args.ks, "batch_sizes": sizes, "context": context}
        timings = workers["melix"].ask(req)
    profiles: dict[str, Any] = {}
    if args.profile and VLM in workers:
        for k in args.ks:
            for rnd, prompt in enumerate(prompts):
                order = ["melix", VLM] if rnd % 2 == 0 else [VLM, "melix"]
                for name in order:
                    req = {"method": "profile", "prompts": [prompt], "max_tokens": args.max_tokens, "k": k}
                    profiles.setdefault(f"{name} k={k}", []).append(workers[name].ask(req))
        profiles = {label: _profile_summary(answers) for label, answers in profiles.items()}
    for worker in workers.values():
        worker.close()
    table = {}
    for cell in cells:
        size = 1 if cell == "single" else int(cell.split()[1])
        row = {}
        for label, _, _, k in contenders:
            row[label] = _summary([r for r in runs if r["cell"] == cell], label)
            if k and "tokens_per_s" in row[label]:
                _ideal(row[label], k, size, timings)
        table[cell] = row
    size_gb = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 1e9
    return {
        "command": " ".join(["python", *sys.argv]),
        "timings_ms": timings,
        "profiles": profiles,
        "head_to_head": {
            cell: _head_to_head([r for r in runs if r["cell"] == cell], args.ks) for cell in cells
        },
        "clock": args.clock,
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


def _profile_summary(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Median ms per cycle over the prompts' runs, part by part."""
    ok = [a for a in answers if "error" not in a]
    if not ok:
        return {"errors": sorted({a["error"] for a in answers})}
    parts = ok[0]["ms_per_cycle"]
    return {
        "runs": len(ok),
        "accepted_mean": statistics.median(a["accepted_mean"] for a in ok),
        "ms_per_cycle": {p: statistics.median(a["ms_per_cycle"][p] for a in ok) for p in parts},
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} ({result['model_gb']} GB), {result['regime']}, greedy, "
        f"{result['max_tokens']} tokens, {result['rounds']} rounds, {result.get('clock', 'wall')} clock",
        "",
        "| cell | contender | tokens/s | x mlx-lm (min-max) | identical to mlx-lm | accepted/round "
        "| of ideal | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell, row in result["cells"].items():
        for label, s in row.items():
            if "tokens_per_s" not in s:
                lines.append(f"| {cell} | {label} | - | - | - | - | - | {'; '.join(s['errors'])[:120]} |")
                continue
            accepted = f"{s['accepted_mean']:.2f}" if "accepted_mean" in s else "-"
            ideal = f"{s['of_ideal']:.2f} of {s['ideal_tokens_per_s']:.1f}" if "of_ideal" in s else "-"
            r = s.get("ratio", {})
            spread = f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
            note = "; ".join(s["errors"])[:80]
            if s["first_differences"]:
                note = (note + " " if note else "") + f"first differs at {s['first_differences']}"
            lines.append(
                f"| {cell} | {label} | {s['tokens_per_s']:.2f} | {spread} | "
                f"{s['identical']}/{s['runs']} | {accepted} | {ideal} | {note} |"
            )
    versus = [(c, k, v) for c, ks in result.get("head_to_head", {}).items() for k, v in ks.items()]
    if versus:
        lines += [
            "",
            "| cell | k | ours / mlx-vlm MTP (min-max over rounds) | verdict |",
            "|---|---|---|---|",
        ]
        for cell, k, v in versus:
            lines.append(
                f"| {cell} | {k} | {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f}) | {v['verdict']} |"
            )
    for label, prof in result.get("profiles", {}).items():
        if "ms_per_cycle" in prof:
            parts = ", ".join(f"{p} {v:.2f}" for p, v in prof["ms_per_cycle"].items())
            lines.append(f"\nprofile {label} (accepted/round {prof['accepted_mean']:.2f}): {parts} ms/cycle")
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
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="decode windows and calibration on the wall clock or each worker's CPU clock (a shared machine)",
    )
    p.add_argument("--cells", nargs="+", choices=["single", "batch"], default=["single", "batch"])
    p.add_argument("--ideal", action="store_true", help="calibrate after the rounds: each contender's ideal")
    p.add_argument("--profile", action="store_true", help="with --peer mlx-vlm: both cycles, part by part")
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
