"""Microbenchmark: selecting each row's recurrent state after a verify (capture.select).

Rules of this script:
- A script, not a test: `python benchmarks/bench_capture_select.py [--model stdlib-hybrid]
  [--batch-size 4] [--k 1]`. Real shapes: the checkpoint is loaded through mlx-lm, a
  batch is prefilled, one verify of k + 1 positions runs armed, and its recorded states
  are evaluated once; only the selection and its evaluation are timed.
- Two forms, interleaved in one process, per-repeat ratios reported with their spread:
  `capture.select` (a chain of `mx.where` with one row mask per position) and the form it
  replaced (stack every position's state, gather along it). Their outputs must be equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.runtime import capture
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def stacked_gather(armed, steps, keep: mx.array) -> None:
    """The former selection: stack the S recorded states, gather each row's."""
    index = keep.astype(mx.int32) - 1
    for c, recorded in zip(armed, steps):
        chosen = []
        for part in range(2):
            stacked = mx.stack([s[part] for s in recorded], axis=1)  # [B, S, ...]
            idx = index.reshape((-1,) + (1,) * (stacked.ndim - 1))
            chosen.append(mx.take_along_axis(stacked, idx, axis=1)[:, 0])
        c.cache = chosen


def timed(select, armed, steps, keep: mx.array, runs: int) -> tuple[float, list[mx.array]]:
    start = time.perf_counter()
    for _ in range(runs):
        select(armed, steps, keep)
        mx.eval([c.cache for c in armed])
    return (time.perf_counter() - start) / runs, [x for c in armed for x in c.cache]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-hybrid")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--runs", type=int, default=20, help="selections timed per repeat")
    args = parser.parse_args()
    model, _ = load(str(resolve_model(args.model)))
    if not capture.install(model):
        raise SystemExit(f"{args.model}: no recurrent layers to capture")
    B, S = args.batch_size, args.k + 1
    cache = make_prompt_cache(model)
    model(mx.random.randint(0, 200, (B, 64)), cache=cache)
    armed = capture.arm(cache)
    model(mx.random.randint(0, 200, (B, S)), cache=cache)
    steps = capture.collect(armed)
    mx.eval(steps)
    keep = mx.array([1 + b % S for b in range(B)])  # rows accept different lengths
    ratios, where_ms, stacked_ms = [], [], []
    for _ in range(args.repeats):
        t_old, old = timed(stacked_gather, armed, steps, keep, args.runs)
        t_new, new = timed(capture.select, armed, steps, keep, args.runs)
        assert all(mx.array_equal(a, b).item() for a, b in zip(old, new)), "the two forms disagree"
        ratios.append(t_old / t_new)
        where_ms.append(t_new * 1e3)
        stacked_ms.append(t_old * 1e3)
    print(
        f"{args.model} B={B} k={args.k} ({len(armed)} recurrent layers): "
        f"capture.select {statistics.median(where_ms):.2f} ms, stacked gather "
        f"{statistics.median(stacked_ms):.2f} ms per selection (medians of {args.repeats}); "
        f"stacked / select {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
