"""Microbenchmark: building (and running) one armed verify forward on a recurrent model.

Rules of this script:
- A script, not a test: `python benchmarks/bench_capture_build.py [--model stdlib-hybrid]
  [--batch-size 1] [--k 1]`. Real shapes: the checkpoint is loaded through mlx-lm, a batch
  is prefilled, then a verify block of k + 1 positions runs with the recurrent caches
  armed (capture). Timed apart: the graph build (the Python that records the forward's
  ops, which a CPU decoder cannot overlap) and its evaluation.
- Two forms of the captured recurrence, interleaved in one process, per-repeat ratios
  with their spread: the ops loop with the gates built once per block (what `capture`
  runs without a Metal device) and mlx-lm's `gated_delta_update` called once per
  position (its Metal form, and what ran everywhere before). Their logits must be equal.
- For scale, mlx-lm's own unarmed forward of the same block is timed the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.runtime import capture
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

FORMS: dict[str, Callable[..., Any]] = {
    "block gates": capture._ops_recurrence,
    "per-position update": capture._update_per_position,
}


def verify_once(
    model: Any, prompt: mx.array, block: mx.array, form: str | None
) -> tuple[float, float, mx.array]:
    """(build s, eval s, logits) of one verify on a freshly prefilled cache; form None: unarmed."""
    cache = make_prompt_cache(model)
    mx.eval(model(prompt, cache=cache), [c.state for c in cache])
    if form is not None:
        capture._ops_recurrence = FORMS[form]  # what `_recur` calls without a Metal device
    armed = capture.arm(cache) if form is not None else []
    start = time.perf_counter()
    logits = model(block, cache=cache)
    steps = capture.collect(armed)
    built = time.perf_counter()
    mx.eval(logits, steps, [c.state for c in cache])
    return built - start, time.perf_counter() - built, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-hybrid")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    if mx.metal.is_available():
        raise SystemExit("a Metal device runs the per-position form only: nothing to compare")
    model, _ = load(str(resolve_model(args.model)))
    layers = capture.install(model)
    if not layers:
        raise SystemExit(f"{args.model}: no recurrent layers to capture")
    B, S = args.batch_size, args.k + 1
    prompt = mx.random.randint(0, 200, (B, 64), key=mx.random.key(0))
    block = mx.random.randint(0, 200, (B, S), key=mx.random.key(1))
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in [*FORMS, "unarmed"]}
    ratios = []
    for _ in range(args.repeats):
        got = {}
        for name in timings:
            build, run, got[name] = verify_once(model, prompt, block, None if name == "unarmed" else name)
            timings[name].append((build, run))
        assert mx.array_equal(got["block gates"], got["per-position update"]).item(), "the forms disagree"
        ratios.append(timings["per-position update"][-1][0] / timings["block gates"][-1][0])
    capture._ops_recurrence = FORMS["block gates"]
    print(f"{args.model} B={B} k={args.k} ({layers} recurrent layers), medians of {args.repeats}:")
    for name, pairs in timings.items():
        build = statistics.median(b for b, _ in pairs) * 1e3
        run = statistics.median(r for _, r in pairs) * 1e3
        print(f"  {name:>20}: build {build:.2f} ms, eval {run:.2f} ms")
    print(
        f"  build, per-position / block gates: {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
