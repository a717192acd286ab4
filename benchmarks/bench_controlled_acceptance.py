"""The speculative cycle's efficiency at a controlled acceptance, per family, without a trained head.

Rules of this script:
- Per family it writes the tiny checkpoint (`make-tiny`; `--hidden` / `--layers` widen it),
  loads it with its own head, and runs mlx-lm's plain greedy decode of every prompt first.
  The draft source is `melix_mlx.tools.controlled_draft.ControlledDraft`: the family's real
  head forward (its cost), proposing the target's greedy token with probability p and a
  wrong one otherwise (position i accepted with probability ~p^i).
- The cells are melix_mlx.tools.bench's (the harness every speed figure comes from): MTP
  forced on against mlx-lm's `stream_generate` (single sequence) and `BatchGenerator`
  (batch B), interleaved ABBA per repeat, with the A/A control; the device policy's auto
  runs are left out (this measures the engine, not the policy).
- Ideal = E[tokens per cycle] / ((t_verify + k t_head) / t_1), from this run's calibrated
  timings (the controlled source in the head slot, so its lookup is priced too) and the
  cell's MEASURED per-position acceptance; efficiency = measured speedup / ideal, median
  over repeats. The acceptance measured is reported beside p. Each repeat is priced by a
  calibration taken just before it (`cycle_costs`; `--no-calibrate-each-repeat`: one
  calibration for the family, as before): between two runs a single calibration's cost
  moved by up to 5 % while the interleaved speedups moved by 2 %, and that moved a
  family's efficiency across 0.9 and back.
- `--calibration-clock cpu` times the calibrated forwards on this process's CPU clock (a
  shared machine's other processes poison wall-clock samples, and the calibration refuses
  them): the ideal needs only ratios of forward costs. `--clock cpu` times the cells the
  same way (this script's own loop: mlx-lm's `generate_step` / `BatchGenerator` against
  `MTPDecoder` / `MTPBatchGenerator`, interleaved ABBA with an A/A run, CPU seconds per
  token after the first); it counts work, so it credits no overlap of host and device
  work, and a contended machine still moves it (the A/A ratios say how much). Beside
  the medians it reports the ratio of each side's fastest run, the least-disturbed one.
- `baseline_over_t1`: mlx-lm's loop per step (B tokens) over the calibrated one-token
  forward, on the cell's clock. The ideal prices a plain token at t_1 (a forward behind its own sync);
  mlx-lm's loop builds token n + 1 while token n computes, so on a quiet machine it can
  pay less than t_1 (below 1: the efficiency is low by that factor, the cycle has no such
  overlap on a CPU), and on a loaded one its two busy threads pay more (above 1: the
  efficiency reads high). Either way it says how far the baseline strays from the ideal's.
- The regime is recorded. The bandwidth-bound CPU regime is OpenBLAS, one thread:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
      python benchmarks/bench_controlled_acceptance.py --families ernie4_5_moe longcat_flash
- Shapes are profiles: the tiny checkpoints as written (`tiny`, forwards of ~1-3 ms, mostly
  fixed host cost: graph building and dispatch), or widened by `--hidden` / `--layers`
  (named `hidden<H>-layers<L>` unless `--profile` names it), whose forwards spend more of
  their time computing. A profile's figures never replace another's.
- The machine's load is recorded: `os.getloadavg()` before and after each family, beside
  the clocks used; a shared machine's other processes move wall-clock figures most.
- Output: a table on stderr, one JSON object on stdout. `--results FILE` also merges the
  measured families into FILE under their profile (benchmarks/results/controlled-acceptance.json
  feeds the docs' family table; schema /2: `profiles.<name>.families.<family>`): per family
  `batch_1` / `batch_<B>` efficiency (null without a calibrated ideal) and the repeats'
  quartiles, the shape, clocks, load, the cells, the regime and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.errors import UnsupportedServing
from melix_mlx.runtime.calibrate import calibrate
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.tools.bench import Bench
from melix_mlx.tools.bench_results import msgspec_builtins, regime
from melix_mlx.tools.controlled_draft import ControlledDraft
from melix_mlx.tools.tiny import make_tiny, tiny_config
from melix_mlx.tools.workloads import Prompt
from mlx_lm.generate import BatchGenerator, generate_step

from melix_fsm.policy.calibration import DEFAULT_BUDGET_S
from melix_fsm.policy.cost_model import TimingTable, expected_tokens_from_positions

TEXTS = [
    "def parse(line):\n    key, _, value = line.partition('=')\n",
    "The quick brown fox jumps over the lazy dog, then",
    "import os\nfor root, dirs, files in os.walk('.'):\n",
    "Numbers: 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8",
]
FIELDS = (
    "ratio",
    "ratio_min",
    "ratio_max",
    "ideal_ratio",
    "efficiency",
    "efficiencies",
    "acceptance_rate",
    "per_position_acceptance",
    "aa_ratios",
    "tps",
    "baseline_tps",
    "breakdown_ms",
    "cycle_costs",
)


class ControlledBench(Bench):
    """The harness's cells without the auto runs (see the rules)."""

    def auto_controller(self, *args: Any, **kwargs: Any) -> None:
        return None


def bench_family(family: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer, head, _ = load_with_heads(path)
    prompts = [Prompt("controlled", text, "fixed") for text in TEXTS]
    bench = ControlledBench(
        model,
        tokenizer,
        head,
        family=family,
        max_tokens=args.tokens,
        repeats=args.reps,
        prompts=prompts,
        calibrate_each_repeat=args.calibrate_each_repeat and args.clock == "wall",
    )
    longest = args.tokens + args.k + 8  # the plain run covers every position a draft can reach
    scripts = [
        p + [t for t, _ in generate_step(mx.array(p), model, max_tokens=longest)] for p in bench.prompts
    ]
    vocab = main_parts(model).args.vocab_size
    bench.head = ControlledDraft(head, scripts, vocab, args.p, seed=args.seed)
    sizes = sorted({1, args.batch})
    out: dict[str, Any] = {"calibration_tries": 0}
    refused = _batch_refusal(model, head, args.batch) if args.batch > 1 else None
    if refused is not None:  # a family that runs one sequence at a time: its batch cell says why
        sizes.remove(args.batch)
        out[f"batch{args.batch}"] = {"refused": refused}

    def cell(size: int) -> Any:
        return bench.single_cell(args.k, 0.0) if size == 1 else bench.batch_cell(size, args.k, 0.0)

    bench.repeats = 1
    for size in sizes:  # warm-up: first-call compilation and allocation stay out of the figures
        cell(size)
    bench.repeats = args.reps
    for _ in range(args.calibration_tries):  # a shared machine can poison one; it is refused, not used
        out["calibration_tries"] += 1
        bench.failures.clear()
        calibration = _calibrate(bench, sizes, args.k, args.calibration_clock)
        if args.k in bench.timings:
            break
    out["calibration"] = calibration
    for size in sizes:
        if args.clock == "cpu":
            row = _cpu_cell(bench, size, args.k)
        else:
            measured = cell(size)  # one run of the cell: every field from the same repeats
            row = {name: getattr(measured, name) for name in FIELDS}
            table = bench.timings.get(args.k)
            if table is not None and row["baseline_tps"]:
                row["baseline_over_t1"] = size / row["baseline_tps"] / table.at(size)[0].t_1
        out["single" if size == 1 else f"batch{size}"] = row
    return out


def _batch_refusal(model: Any, head: Any, size: int) -> str | None:
    """The typed reason the batched generator refuses this family's caches, or None."""
    try:
        MTPBatchGenerator(model, head, num_draft_tokens=1, completion_batch_size=size).close()
    except UnsupportedServing as exc:
        return str(exc)  # "<reason>: <message>"
    return None


# -- the same cells on this process's CPU clock (--clock cpu) --------------------------------
def _per_token(tokens: Any) -> float:
    """CPU seconds per generated token after the first (the prefill's)."""
    start, n = None, 0
    for _ in tokens:
        if start is None:
            start = time.process_time()
        else:
            n += 1
    return (time.process_time() - start) / max(n, 1)


def _plain_batch(model: Any, prompts: list[list[int]], n: int) -> float:
    gen = BatchGenerator(model, max_tokens=n, completion_batch_size=len(prompts))
    try:
        return _per_token(_batch_tokens(gen, prompts, n))
    finally:
        gen.close()


def _batch_tokens(gen: Any, prompts: list[list[int]], max_tokens: int) -> Any:
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    while responses := gen.next_generated():
        yield from responses


def _cpu_cell(bench: Bench, size: int, k: int) -> dict[str, Any]:
    """Plain (mlx-lm) and MTP forced on, interleaved ABBA with an A/A run, on the CPU clock;
    speedup, ideal and efficiency per repeat as the harness computes them, medians."""
    model, head, n = bench.model, bench.head, bench.max_tokens
    table = bench.timings.get(k)
    cost = table.at(size)[0].cycle_cost if table is not None else None
    t_1 = table.at(size)[0].t_1 if table is not None else None
    ratios, ideals, effs, aa, accepted, proposed = [], [], [], [], 0, 0
    per_token: dict[str, list[float]] = {"plain": [], "mtp": []}
    fastest = {"plain": float("inf"), "mtp": float("inf")}  # each side's least-disturbed run
    for r in range(bench.repeats):
        prompts = [bench.prompts[(r + i) % len(bench.prompts)] for i in range(size)]
        if size == 1:
            decoder = MTPDecoder(model, head, num_draft_tokens=k)
            runs = {
                "plain": lambda p=prompts[0]: _per_token(generate_step(mx.array(p), model, max_tokens=n)),
                "mtp": lambda p=prompts[0], d=decoder: _per_token(d.generate(mx.array(p), n)),
            }
        else:
            gen = MTPBatchGenerator(model, head, num_draft_tokens=k, max_tokens=n, completion_batch_size=size)
            runs = {
                "plain": lambda ps=prompts: _plain_batch(model, ps, n),
                "mtp": lambda g=gen, ps=prompts: _per_token(_batch_tokens(g, ps, n)),
            }
        runs["plain_again"] = runs["plain"]
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        t = {name: runs[name]() for name in order}
        per_token["plain"].append(t["plain"])
        per_token["mtp"].append(t["mtp"])
        stats = decoder.stats if size == 1 else gen.speculative_stats()
        accepted, proposed = accepted + stats["accepted"], proposed + stats["proposed"]
        ratios.append(t["plain"] / t["mtp"])
        fastest["plain"], fastest["mtp"] = min(fastest["plain"], t["plain"]), min(fastest["mtp"], t["mtp"])
        aa.append(t["plain"] / t["plain_again"])
        if cost:
            ideals.append(expected_tokens_from_positions(stats["per_position_acceptance"][:k]) / cost)
            effs.append(ratios[-1] / ideals[-1])
    return {
        "clock": "cpu",
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ideal_ratio": statistics.median(ideals) if ideals else None,
        "efficiency": statistics.median(effs) if effs else None,
        "efficiencies": effs,
        "acceptance_rate": accepted / max(proposed, 1),
        "aa_ratios": aa,
        # on a contended machine noise only adds time: the fastest runs' ratio is the
        # least-disturbed estimate (reported beside the medians, never instead of them)
        "ratio_of_fastest": fastest["plain"] / fastest["mtp"],
        "efficiency_of_fastest": fastest["plain"] / fastest["mtp"] / statistics.median(ideals)
        if ideals
        else None,
        "plain_ms_per_token": statistics.median(per_token["plain"]) * 1e3,
        "mtp_ms_per_token": statistics.median(per_token["mtp"]) * 1e3,
        # mlx-lm's loop per token over the calibrated one-token forward (see baseline_over_t1)
        # a step of B rows makes B tokens
        "baseline_over_t1": statistics.median(per_token["plain"]) * size / t_1 if t_1 else None,
    }


def _calibrate(bench: Bench, sizes: list[int], k: int, clock: str) -> Any:
    """The harness's calibration (`Bench.calibrate`), on the wall clock or on this process's
    CPU clock: the ideal needs only the ratios (t_verify + k t_head) / t_1, and CPU time
    is what other processes on a shared machine do not move (they poison wall-clock
    samples, which the calibration then refuses)."""
    if clock == "wall":
        return bench.calibrate(sizes, [k])
    table = calibrate(
        bench.model,
        bench.head,
        batch_sizes=sizes,
        k=k,
        runs=9,
        context={b: bench.context(b) for b in sizes},
        budget_s=DEFAULT_BUDGET_S * len(sizes),
        timer=time.process_time,
    )
    if isinstance(table, TimingTable):
        bench.timings[k] = table
        return {str(k): [msgspec_builtins(t) for t in table.entries], "clock": "cpu"}
    bench.failures[k] = table
    return {str(k): {"error": table.reason, "detail": str(table)}, "clock": "cpu"}


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else "-"


def quartiles(values: list[float] | None) -> list[float] | None:
    """The first and third quartile of the repeats' efficiencies (their spread)."""
    if not values or len(values) < 2:
        return None
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def _quartiles(values: list[float] | None) -> str:
    q = quartiles(values)
    return "-" if q is None else f"{q[0]:.2f}-{q[1]:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["ernie4_5_moe", "longcat_flash", "deepseek_v3"])
    parser.add_argument("--p", type=float, default=0.8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    # short runs are a few dozen cycles: a stray millisecond moves a repeat by several per cent
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration-tries", type=int, default=5)
    parser.add_argument(
        "--calibration-clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time the calibrated forwards on the wall clock or this process's CPU clock",
    )
    parser.add_argument(
        "--calibrate-each-repeat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="price each repeat by a calibration taken just before it (wall clock; see the rules)",
    )
    parser.add_argument("--results", default=None, help="merge the figures into this JSON file")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="time the cells on the wall or CPU clock"
    )
    parser.add_argument("--hidden", type=int, default=None, help="hidden size of the tiny models")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the tiny models")
    parser.add_argument(
        "--scale",
        type=int,
        default=None,
        help="realistic proportions: hidden size, FFN / expert widths, LoRA ranks and head counts times this",
    )
    parser.add_argument(
        "--profile", default=None, help="the results' profile name (default: tiny, or hidden<H>-layers<L>)"
    )
    args = parser.parse_args()
    shape = {k: v for k, v in (("hidden_size", args.hidden), ("num_hidden_layers", args.layers)) if v}
    result: dict[str, Any] = {"regime": regime(), "args": vars(args), "families": {}}
    args.profile = args.profile or profile_name(args.hidden, args.layers, args.scale)
    result["profile"] = args.profile
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            sizes = {**scaled_sizes(family, args.scale), **shape} if args.scale else shape
            path = str(make_tiny(family, f"{tmp}/{family}", **sizes))
            start = os.getloadavg()
            result["families"][family] = bench_family(family, path, args)
            result["families"][family]["load_average"] = {"start": list(start), "end": list(os.getloadavg())}
    print(
        f"regime: {result['regime']['blas']} ({result['regime']['blas_threads']} threads); p = {args.p}, "
        f"k = {args.k}, {args.tokens} tokens, median of {args.reps}; profile {args.profile}; "
        f"clocks: cells {args.clock}, calibration {args.calibration_clock}",
        file=sys.stderr,
    )
    print(
        f"{'family':14} {'cell':7} {'speedup':>8} {'ideal':>7} {'effic':>7} {'quartiles':>11} "
        f"{'accept':>7} {'A/A':>12} "
        f"{'fastest: speedup':>17} {'effic':>6} {'base/t1':>8}",
        file=sys.stderr,
    )
    for family, cells in result["families"].items():
        load = cells["load_average"]
        print(
            f"{family:14} load average (1 min) {load['start'][0]:.2f} -> {load['end'][0]:.2f}",
            file=sys.stderr,
        )
        for name, row in cells.items():
            if not isinstance(row, dict) or "ratio" not in row:
                continue
            aa = row["aa_ratios"]
            aa_s = f"{min(aa):.2f}-{max(aa):.2f}" if aa else "-"
            print(
                f"{family:14} {name:7} {_fmt(row['ratio']):>8} {_fmt(row['ideal_ratio']):>7} "
                f"{_fmt(row['efficiency']):>7} {_quartiles(row.get('efficiencies')):>11} "
                f"{_fmt(row['acceptance_rate']):>7} {aa_s:>12} "
                f"{_fmt(row.get('ratio_of_fastest')):>17} {_fmt(row.get('efficiency_of_fastest')):>6} "
                f"{_fmt(row.get('baseline_over_t1')):>8}",
                file=sys.stderr,
            )
    print(json.dumps(result))
    if args.results:
        _merge(Path(args.results), result, args)
    return 0


def profile_name(hidden: int | None, layers: int | None, scale: int | None = None) -> str:
    """The profile a shape's figures are filed under: `tiny` as written, else its overrides."""
    parts = [f"{name}{v}" for name, v in (("scale", scale), ("hidden", hidden), ("layers", layers)) if v]
    return "-".join(parts) or "tiny"


# the widths a realistic checkpoint grows together: the residual stream, every FFN and
# expert, the MLA / indexer ranks and every head count (head dims stay: real models keep
# 64-256 per head and add heads); scaling hidden alone leaves the projections tiny
_SCALED = re.compile(
    r"^(hidden_size|.*intermediate_size|.*ffn_hidden_size|share_expert_dim|[qo]_lora_rank|kv_lora_rank"
    r"|.*num_attention_heads|.*num_key_value_heads|num_attention_groups|linear_num_\w+_heads"
    r"|mamba_num_heads|index_n_heads)$"
)


def scaled_sizes(family: str, factor: int) -> dict[str, int]:
    """The config overrides of `family`'s tiny checkpoint at `factor` times its widths."""
    _, text = tiny_config(family, {})
    return {
        key: value * factor
        for key, value in text.items()
        if _SCALED.match(key) and isinstance(value, int) and not isinstance(value, bool)
    }


SCHEMA = "melix-fsm/controlled-acceptance/2"


def load_results(path: Path) -> dict[str, Any]:
    """The results file in schema /2; a /1 file (one shape: `families` at the top, all of
    them measured on the tiny checkpoints) is read as the `tiny` profile."""
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if "families" in data and "profiles" not in data:
        data = {"profiles": {"tiny": {"families": data["families"]}}}
    data["schema"] = SCHEMA
    data.setdefault("profiles", {})
    return data


def _merge(path: Path, result: dict[str, Any], args: argparse.Namespace) -> None:
    """Add this run's families to their profile in the results file (one entry per family
    and profile: the latest run); other profiles are left as they are."""
    data = load_results(path)
    profile = data["profiles"].setdefault(args.profile, {})
    shape = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "tokens": args.tokens}
    profile["shape"] = {**shape, "scale": args.scale} if getattr(args, "scale", None) else shape
    families = profile.setdefault("families", {})
    for family, cells in result["families"].items():
        families[family] = {
            "batch_1": cells["single"]["efficiency"],
            f"batch_{args.batch}": cells[f"batch{args.batch}"].get("efficiency"),  # None: refused
            "batch_1_quartiles": quartiles(cells["single"].get("efficiencies")),
            f"batch_{args.batch}_quartiles": quartiles(cells[f"batch{args.batch}"].get("efficiencies")),
            "shape": profile["shape"],
            "p": args.p,
            "k": args.k,
            "clock": args.clock,
            "calibration_clock": args.calibration_clock,
            "load_average": cells["load_average"],
            "regime": result["regime"],
            "command": " ".join(sys.argv),
            "cells": cells,
        }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
