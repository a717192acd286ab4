"""t_1, t_verify(k+1) and the head step of widened checkpoints, to choose realistic sizes.

Usage (OpenBLAS, one thread, as the realistic-size regime is measured):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \
        python benchmarks/bench_widen_sizes.py MODEL [MODEL ...] [--k 2] [--rounds 15]

MODEL is a folder, an embedded name or a widened preset (`stdlib-hybrid-wide`). The three
forwards are the calibration's own (`melix_mlx.runtime.calibrate.build_forwards`: batch 1, a
64-token cache put back after every run), interleaved round by round so a noisy shared
CPU hits them alike; the ratio is taken per round. Prints one JSON line per model:
median and [min, max] of each figure, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(model_arg: str, k: int, rounds: int) -> dict:
    from melix_mlx.loading import load_with_heads
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.runtime.calibrate import build_forwards

    path = resolve_model(model_arg)
    model, _, head, info = load_with_heads(path)
    fns = build_forwards(model, head, batch_size=1, k=k, prompt_len=64)
    for fn in fns:  # warm-up: graph building, first-touch of the weights
        fn()
        fn()
    samples: list[list[float]] = [[], [], []]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            samples[i].append(1e3 * (time.perf_counter() - t))
    t1, tv, th = samples
    return {
        "model": str(model_arg),
        "family": info.family,
        "bytes": sum(f.stat().st_size for f in Path(path).glob("*.safetensors")),
        "k": k,
        "rounds": rounds,
        "regime": "openblas" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference",
        "threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "t_1_ms": _spread(t1),
        "t_verify_ms": _spread(tv),
        "t_head_ms": _spread(th),
        "verify_over_t1": _spread([v / o for v, o in zip(tv, t1)]),
        "head_over_t1": _spread([h / o for h, o in zip(th, t1)]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--k", type=int, default=2, help="drafts per verify (verify runs k+1 tokens)")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    for m in args.models:
        print(json.dumps(measure(m, args.k, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
