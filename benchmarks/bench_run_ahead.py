"""MTP against mlx-lm with the engine's run-ahead on or off (figures for BENCHMARKS.md).

Rules of this script:
- One process, one loaded embedded checkpoint, held-out prompts (melix_mlx.tools.workloads).
- Single sequence: `MTPDecoder` against mlx-lm's `generate_step`, the same prompt run by
  both back to back; decode tokens/s from the first yielded token on (prefill excluded);
  the figure is the median ratio over the prompts, each run twice.
- Batched: `MTPBatchGenerator` against mlx-lm's `BatchGenerator` on the same B prompts,
  interleaved `--repeats` times; tokens/s from the first generated response on; the
  median ratio and its min-max.
- `--run-ahead on|off` forces the engine's run-ahead (docs/engine.md); `default` leaves
  the device's default (off on a CPU). Run it twice, once each way, to compare.
- The BLAS regime is the environment's (preload OpenBLAS and set OPENBLAS_NUM_THREADS=1
  for the bandwidth-bound regime `melix-fsm bench --regime openblas` uses).

Usage: python benchmarks/bench_run_ahead.py [--model stdlib-tiny] [--k 2] [--batch-sizes 1 4 8]
       [--run-ahead on|off|default] [--tokens 64] [--repeats 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
from bench_off_paths import decode_rate  # run from benchmarks/: the one rate helper
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.tools.workloads import held_out_prompts
from mlx_lm.generate import BatchGenerator, generate_step


def _batch_tps(gen: Any, prompts: list[list[int]], tokens: int) -> float:
    gen.insert(prompts, max_tokens=[tokens] * len(prompts))
    n, start = 0, None
    while out := gen.next_generated():
        if start is None:  # from the first generated response on: prefill excluded
            start = time.perf_counter()
            continue
        n += len(out)
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="stdlib-tiny")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--run-ahead", choices=["on", "off", "default"], default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    kw = {} if args.run_ahead == "default" else {"run_ahead": args.run_ahead == "on"}
    path = resolve_model(args.model)
    model, tokenizer, head, _ = load_with_heads(path)
    prompts = [tokenizer.encode(p.text) for p in held_out_prompts(path)]

    ratios = []
    for p in prompts[:3] * 2:
        plain = decode_rate(generate_step(mx.array(p), model, max_tokens=args.tokens))
        decoder = MTPDecoder(model, head, num_draft_tokens=args.k, **kw)
        ratios.append(decode_rate(decoder.generate(mx.array(p), args.tokens)) / plain)
    print(f"run-ahead {args.run_ahead}: single k={args.k} ratio median {statistics.median(ratios):.3f}")
    for size in args.batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        ratios = []
        for _ in range(args.repeats):
            base = _batch_tps(BatchGenerator(model, max_tokens=args.tokens), batch, args.tokens)
            gen = MTPBatchGenerator(model, head, num_draft_tokens=args.k, max_tokens=args.tokens, **kw)
            ratios.append(_batch_tps(gen, batch, args.tokens) / base)
        print(
            f"run-ahead {args.run_ahead}: B={size} k={args.k} ratio median {statistics.median(ratios):.3f} "
            f"spread {min(ratios):.2f}-{max(ratios):.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
