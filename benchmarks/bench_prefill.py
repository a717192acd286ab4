"""Benchmark: how long a batch of requests takes to get every row's first token.

Rules of this script:
- A script, not a test: `python benchmarks/bench_prefill.py [--model stdlib-hybrid]
  [--batch-sizes 2 4 8] [--repeats 3]`. B held-out prompts (the bench's workloads) are
  inserted at once into a generator with B rows; the clock runs from `insert` until
  every row has received its first token (the batch's time to first token).
- Three generators, interleaved in ABBA order in one process, per-repeat ratios with
  their spread: mlx-lm's `BatchGenerator`, `MTPBatchGenerator` as it is (fresh
  requests prefilled together), and `MTPBatchGenerator` prefilling each row alone
  (`joins_fresh` patched off: what it did before the joint prefill).
- Each generator's first tokens are checked equal to mlx-lm's (greedy).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import melix_mlx.decoding.batch_admission as batch_admission  # where admission asks joins_fresh
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.tools.workloads import held_out_prompts
from mlx_lm.generate import BatchGenerator


def first_tokens(gen: Any, prompts: list[list[int]]) -> tuple[float, dict[int, int]]:
    """(seconds from insert until every row's first token, first token per row)."""
    tic = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[2] * len(prompts))
    first: dict[int, int] = {}
    while len(first) < len(uids):
        for r in gen.next()[1]:
            first.setdefault(r.uid, r.token)
    seconds = time.perf_counter() - tic
    gen.close()
    return seconds, {i: first[u] for i, u in enumerate(uids)}


def ratio(times: dict[str, list[float]], name: str) -> str:
    """Median per-repeat ratio to mlx-lm's, with its spread."""
    ratios = [a / b for a, b in zip(times[name], times["mlx-lm"])]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-hybrid")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    model, tokenizer, head, _ = load_with_heads(model_dir)
    texts = [p.text for p in held_out_prompts(model_dir)]
    joins_fresh = batch_admission.joins_fresh

    def alone(B: int) -> MTPBatchGenerator:
        batch_admission.joins_fresh = lambda request: False
        return MTPBatchGenerator(model, head, completion_batch_size=B, prefill_batch_size=B)

    makers: dict[str, Callable[[int], Any]] = {
        "mlx-lm": lambda B: BatchGenerator(model, completion_batch_size=B, prefill_batch_size=B),
        "together": lambda B: MTPBatchGenerator(model, head, completion_batch_size=B, prefill_batch_size=B),
        "alone": alone,
    }
    print(f"model {args.model}; seconds until every row's first token, median of {args.repeats}")
    print(
        "| B | prompt tokens | mlx-lm s | together s | alone s "
        "| together / mlx-lm (spread) | alone / mlx-lm (spread) |"
    )
    print("|---|---|---|---|---|---|---|")
    for B in args.batch_sizes:
        prompts = [tokenizer.encode(texts[i % len(texts)])[:700] for i in range(B)]
        times: dict[str, list[float]] = {name: [] for name in makers}
        for r in range(args.repeats + 1):  # the first round warms up, untimed
            order = list(makers) if r % 2 else list(reversed(makers))
            tokens = {}
            for name in order:
                seconds, tokens[name] = first_tokens(makers[name](B), prompts)
                batch_admission.joins_fresh = joins_fresh
                if r:
                    times[name].append(seconds)
            if tokens["together"] != tokens["mlx-lm"] or tokens["alone"] != tokens["mlx-lm"]:
                raise SystemExit(f"B={B}: first tokens differ from mlx-lm's: {tokens}")
        med = {name: statistics.median(v) for name, v in times.items()}
        print(
            f"| {B} | {sum(map(len, prompts))} | {med['mlx-lm']:.2f} | {med['together']:.2f} "
            f"| {med['alone']:.2f} | {ratio(times, 'together')} | {ratio(times, 'alone')} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
