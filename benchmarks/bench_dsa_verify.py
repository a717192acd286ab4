"""Microbenchmark: one sparse-attention (DSA) verify against the one-token steps it stands for.

Rules of this script:
- A script, not a test: `python benchmarks/bench_dsa_verify.py [--context 1024]
  [--topk 128] [--block 3] [--repeats 20]`. A tiny deepseek_v32 checkpoint
  (melix_mlx.tools.tiny, ``index_topk`` as given, below the context so the indexer drops
  keys) is prefilled once; every repeat copies that cache and runs, interleaved:
  the block as one verify in melix_mlx.runtime.dsa's form (armed), the block as one-token
  steps (what it must equal), and mlx-lm's own multi-token forward of the block.
- The verify's logits must equal the steps' bit for bit; the script says so or fails.
- Medians (ms) of build + evaluation per form.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import mlx.core as mx
from melix_mlx.runtime import absorbed_mla, rollback
from melix_mlx.tools.tiny import make_tiny
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def _copy(model: Any, base: list[Any]) -> list[Any]:
    cache = make_prompt_cache(model)
    for c, b in zip(rollback.leaves(cache), rollback.leaves(base), strict=True):
        c.keys, c.values, c.offset = mx.array(b.keys), mx.array(b.values), b.offset
    return cache


def _run(model: Any, base: list[Any], block: mx.array, form: str) -> tuple[float, mx.array]:
    cache = _copy(model, base)
    mx.eval([c.keys for c in rollback.leaves(cache)])
    t = time.perf_counter()
    if form == "steps":
        out = mx.concatenate([model(block[:, i : i + 1], cache=cache) for i in range(block.shape[1])], axis=1)
    else:
        marked = absorbed_mla.arm(rollback.leaves(cache)) if form == "verify" else []
        out = model(block, cache=cache)
        absorbed_mla.disarm(marked)
    mx.eval(out)
    return time.perf_counter() - t, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load(str(make_tiny("deepseek_v32", tmp, index_topk=args.topk)))
    absorbed_mla.install(model)
    mx.random.seed(0)
    base = make_prompt_cache(model)
    model(mx.random.randint(0, 250, (1, args.context)), cache=base)
    mx.eval([c.keys for c in rollback.leaves(base)])
    block = mx.random.randint(0, 250, (1, args.block))
    times: dict[str, list[float]] = {"verify": [], "steps": [], "mlx-lm multi-token": []}
    for _ in range(args.repeats):
        outs = {}
        for form in times:
            dt, outs[form] = _run(model, base, block, form)
            times[form].append(dt)
        if not mx.array_equal(outs["verify"], outs["steps"]).item():
            raise SystemExit("the verify differs from the one-token steps")
    print(f"context {args.context}, index_topk {args.topk}, block {args.block}: verify == steps bit for bit")
    for form, ts in times.items():
        print(f"{form:>20}: {statistics.median(ts) * 1e3:7.2f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
