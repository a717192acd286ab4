"""Run-ahead on against off, interleaved in one process, on a family at realistic proportions.

Rules of this script:
- Per family: the make-tiny checkpoint at `--scale` times its widths and `--layers` layers
  (bench_controlled_acceptance.scaled_sizes), loaded with its head; the draft source is
  `ControlledDraft` at `--p` (the family's real head forward, the target's greedy token
  with probability p), as in bench_controlled_acceptance.py.
- Each repeat runs three single-sequence decodes of one prompt, in ABC order on even
  repeats and CBA on odd ones: mlx-lm's `generate_step`, `MTPDecoder(run_ahead=False)` and
  `MTPDecoder(run_ahead=True)`; decode tokens/s from the first yielded token on (prefill
  excluded). Repeat 0 is a warm-up and is dropped.
- Reported per family: on / off and each over plain, the median over repeats and the
  spread (min-max). A figure inside the spread is not a difference.
- The BLAS regime is the environment's: preload OpenBLAS with OPENBLAS_NUM_THREADS=1 for
  the bandwidth-bound one (docs/engine.md, "Run-ahead", says why it is off on a CPU).

Usage: python benchmarks/compare_run_ahead.py ernie4_5_moe glm_moe_dsa [--scale 16] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from typing import Any

import mlx.core as mx
from bench_controlled_acceptance import TEXTS, scaled_sizes  # run from benchmarks/
from bench_off_paths import decode_rate
from melix_mlx.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.tools.bench_results import regime
from melix_mlx.tools.controlled_draft import ControlledDraft
from melix_mlx.tools.tiny import make_tiny
from mlx_lm.generate import generate_step


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(family: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    sizes = {**scaled_sizes(family, args.scale), "num_hidden_layers": args.layers}
    model, tokenizer, head, _ = load_with_heads(str(make_tiny(family, f"{tmp}/{family}", **sizes)))
    prompts = [tokenizer.encode(text) for text in TEXTS]
    longest = args.tokens + 16  # the plain run covers every position a draft can reach
    scripts = [p + [t for t, _ in generate_step(mx.array(p), model, max_tokens=longest)] for p in prompts]
    draft = ControlledDraft(head, scripts, main_parts(model).args.vocab_size, args.p, seed=0)

    def mtp(prompt: list[int], ahead: bool) -> float:
        decoder = MTPDecoder(model, draft, num_draft_tokens=args.k, run_ahead=ahead)
        return decode_rate(decoder.generate(mx.array(prompt), args.tokens))

    rates: dict[str, list[float]] = {"plain": [], "off": [], "on": []}
    for r in range(args.repeats + 1):
        p = prompts[r % len(prompts)]
        runs = {
            "plain": lambda p=p: decode_rate(generate_step(mx.array(p), model, max_tokens=args.tokens)),
            "off": lambda p=p: mtp(p, False),
            "on": lambda p=p: mtp(p, True),
        }
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        out = {name: runs[name]() for name in order}
        if r > 0:  # repeat 0 warms up
            for name, rate in out.items():
                rates[name].append(rate)
    pairs = {
        "on_over_off": ("on", "off"),
        "off_over_plain": ("off", "plain"),
        "on_over_plain": ("on", "plain"),
    }
    return {
        name: _summary([a / b for a, b in zip(rates[x], rates[y], strict=True)])
        for name, (x, y) in pairs.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="+")
    parser.add_argument("--scale", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--p", type=float, default=0.8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    result: dict[str, Any] = {"regime": regime(), "args": vars(args), "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            figures = compare(family, args, tmp)
            result["families"][family] = figures
            print(
                f"{family}: on/off {figures['on_over_off']['median']:.3f} "
                f"({figures['on_over_off']['min']:.2f}-{figures['on_over_off']['max']:.2f}), "
                f"off/plain {figures['off_over_plain']['median']:.3f}, "
                f"on/plain {figures['on_over_plain']['median']:.3f}",
                file=sys.stderr,
                flush=True,
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
