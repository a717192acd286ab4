"""Peers on the same checkpoint, interleaved in one run: the coordinator behind
benchmarks/bench_peers.py and `melix-fsm bench --peer` (greedy, held-out prompts, decode
tokens/s, identity to mlx-lm, the ideal bound, both cycles profiled).

Rules of this module:
- One worker process per contender (melix_mlx/tools/peer_worker.py, run as a script so a
  peer's role imports nothing of this package) loads the checkpoint once: `melix` (this
  project and mlx-lm's own paths), `mlx-vlm` (the installed mlx-vlm through
  melix_mlx.tools.peers_vlm: its MTP at each k and its plain decode), and one per
  NAME=CHECKOUT peer (an mlx_lm fork first on PYTHONPATH; never vendored).
- Per round and cell every contender decodes the same prompts, in an order reversed every
  other round and rotated every round (ABBA), after one warm-up pass that is not
  recorded. A crash or a missing method is that cell's recorded error, never dropped.
- Per cell and contender: decode tokens/s (median), the ratio to mlx-lm in the same round
  (median, min-max), identity to mlx-lm's greedy tokens, accepted drafts per row and
  round; with mlx-vlm, ours over mlx-vlm's MTP per round at each k with a verdict:
  `ahead` when every round is, `behind` when every round is behind, else `level`.
- `ideal`: this project's calibrated forward times in the same run (after the rounds, at
  the cells' context) give each speculative contender's bound B (1 + a) / (t_verify +
  k t_head) from its own acceptance a; `of_ideal` is the measured share of it.
- `profile` (with mlx-vlm): the single-sequence cycle of both, part by part, per k.
- `clock` `cpu` reads every decode window and the calibration on each worker's CPU clock
  (a shared machine's other processes do not count; host-device overlap is not credited).
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

WORKER = Path(__file__).with_name("peer_worker.py")


def _ours_path() -> list[str]:
    """PYTHONPATH for our workers: this package's and the core's parents, then the caller's."""
    import melix_fsm
    import melix_mlx

    roots = {
        str(Path(melix_mlx.__file__).resolve().parents[1]),
        str(Path(melix_fsm.__file__).resolve().parents[1]),
    }
    return [*sorted(roots), os.environ.get("PYTHONPATH", "")]


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


def _workers(args: argparse.Namespace, model: Path) -> tuple[dict[str, Worker], dict[str, Any]]:
    ours = _ours_path()
    workers = {"melix": Worker("melix", "melix", model, sys.executable, ours, args.clock)}
    peers: dict[str, dict[str, Any]] = {}
    for spec in args.peer:
        name, _, checkout = spec.partition("=")
        if name == VLM and not checkout:  # the installed mlx-vlm, through our glue
            from importlib.metadata import version

            workers[name] = Worker(name, VLM, model, sys.executable, ours, args.clock)
            peers[name] = {"installed": f"mlx-vlm {version('mlx-vlm')}"}
            continue
        python = args.peer_python or sys.executable
        workers[name] = Worker(name, "peer", model, python, [checkout], args.clock)
        peers[name] = {"checkout": checkout, "commit": _commit(Path(checkout))}
    return workers, peers


def _size(cell: str) -> int:
    return 1 if cell == "single" else int(cell.split()[1])


def _record(rnd: int, cell: str, label: str, answer: dict[str, Any], reference: dict[str, Any]) -> dict:
    record: dict[str, Any] = {"round": rnd, "cell": cell, "label": label}
    if "error" in answer:
        record["error"] = answer["error"]
        return record
    tps = answer["decode_tokens"] / max(answer["decode_s"], 1e-9)
    ref_tps = reference["decode_tokens"] / max(reference["decode_s"], 1e-9)
    diffs = [_first_difference(a, b) for a, b in zip(answer["tokens"], reference["tokens"])]
    record.update(tps=tps, ratio=tps / ref_tps if ref_tps else None)
    if "accepted_mean" in answer:
        record.update(cycles=answer["cycles"], accepted_mean=answer["accepted_mean"])
    record["identical"] = all(d is None for d in diffs)
    record["first_difference"] = next((d for d in diffs if d is not None), None)
    return record


def _rounds(
    args: argparse.Namespace,
    workers: dict[str, Worker],
    contenders: list[tuple[str, str, str, int]],
    cells: list[str],
    prompts: list[list[int]],
) -> list[dict[str, Any]]:
    """Every recorded run, after one warm-up pass (first calls build kernels and caches)."""
    for cell in cells:
        for _, worker, method, k in contenders:
            req = {"method": method, "prompts": prompts[:1] * _size(cell), "max_tokens": 8, "k": k}
            workers[worker].ask(dict(req, batch=cell != "single"))
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for rnd in range(args.rounds):
        for cell in cells:
            size = _size(cell)
            group = [prompts[(rnd * size + i) % len(prompts)] for i in range(size)]
            order = contenders if rnd % 2 == 0 else list(reversed(contenders))
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            answers = {}
            for label, worker, method, k in order:
                # `single` is the sequence path; `batch B` a generator (B = 1 included)
                req = {"method": method, "prompts": group, "max_tokens": args.max_tokens, "k": k}
                answers[label] = workers[worker].ask(dict(req, batch=cell != "single"))
            runs += [_record(rnd, cell, label, answers[label], answers["mlx-lm"]) for label, *_ in contenders]
            done = time.perf_counter() - started
            print(f"round {rnd + 1}/{args.rounds} {cell} done at {done:.0f} s", file=sys.stderr, flush=True)
    return runs


def _profiles(
    args: argparse.Namespace, workers: dict[str, Worker], prompts: list[list[int]]
) -> dict[str, Any]:
    """Both single-sequence cycles per k, over every prompt, the order alternating."""
    answers: dict[str, list[dict[str, Any]]] = {}
    for k in args.ks:
        for rnd, prompt in enumerate(prompts):
            for name in ["melix", VLM] if rnd % 2 == 0 else [VLM, "melix"]:
                req = {"method": "profile", "prompts": [prompt], "max_tokens": args.max_tokens, "k": k}
                answers.setdefault(f"{name} k={k}", []).append(workers[name].ask(req))
    return {label: _profile_summary(found) for label, found in answers.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The comparison `args` names (see benchmarks/bench_peers.py for the options)."""
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools.bench_results import regime
    from melix_mlx.tools.workloads import held_out_prompts

    model = resolve_model(args.model)
    texts = [p.text[: args.prompt_chars] if args.prompt_chars else p.text for p in held_out_prompts(model)]
    started = time.perf_counter()
    workers, peers = _workers(args, model)
    prompts = workers["melix"].ask({"method": "encode", "texts": texts})["ids"]
    contenders = _contenders(args.ks, list(peers))
    cells = (["single"] if "single" in args.cells else []) + (
        [f"batch {b}" for b in args.batch_sizes] if "batch" in args.cells else []
    )
    runs = _rounds(args, workers, contenders, cells, prompts)
    timings: dict[str, Any] = {}
    if args.ideal:  # after the rounds: the same process, warm, at the cells' context
        sizes = sorted({1, *(_size(c) for c in cells)})
        context = max(len(p) for p in prompts) + args.max_tokens // 2
        req = {"method": "calibrate", "ks": args.ks, "batch_sizes": sizes, "context": context}
        timings = workers["melix"].ask(req)
    profiles = _profiles(args, workers, prompts) if args.profile and VLM in workers else {}
    for worker in workers.values():
        worker.close()
    table = {}
    for cell in cells:
        row = {}
        for label, _, _, k in contenders:
            row[label] = _summary([r for r in runs if r["cell"] == cell], label)
            if k and "tokens_per_s" in row[label]:
                _ideal(row[label], k, _size(cell), timings)
        table[cell] = row
    size_gb = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 1e9
    versus = {cell: _head_to_head([r for r in runs if r["cell"] == cell], args.ks) for cell in cells}
    return {
        "command": " ".join(getattr(args, "command", None) or [Path(sys.argv[0]).name, *sys.argv[1:]]),
        "clock": args.clock,
        "model": str(args.model),
        "model_gb": round(size_gb, 2),
        "regime": regime(),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "prompt_chars": args.prompt_chars,
        "peers": peers,
        "cells": table,
        "head_to_head": versus,
        "timings_ms": timings,
        "profiles": profiles,
        "runs": runs,
        "wall_s": time.perf_counter() - started,
    }


def write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


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
