"""Single-sequence MTP vs mlx-lm's generate_step on the tiny checkpoints (figures for the note).

Rules of this script:
- Per family it measures, in ONE process and interleaved (every repetition runs every
  method once, in a rotating order, after one warm-up run of each): decode wall time
  per token of mlx-lm's `generate_step` (the baseline) and of `MTPDecoder` with k = 1, 2.
  Decode time runs from the first yielded token to the last, so the prefill is excluded.
  The figure is the median over repetitions; ratios are MTP / baseline (< 1 is faster).
- "random" rows use the checkpoint's own random-weight head (acceptance ~0: the cost of
  speculating for nothing). "oracle" rows run the same head forward (so its cost is
  paid) but replace its draft by mlx-lm's own next token, giving acceptance 1: the best
  case a perfectly trained head could reach in this regime.
- Target forwards per emitted token count verify, plain and replay forwards over the
  tokens after the prefill's first; the baseline's is 1.
- The BLAS regime is reported: `LD_PRELOAD` naming OpenBLAS means the bandwidth-bound
  regime (multi-token forwards ~ as cheap as one), else the wheel's reference BLAS
  (compute-bound). BENCHMARKS.md explains why both verdicts matter.
- Output: a table on stderr and one JSON object on stdout.

Usage: python benchmarks/bench_single.py [--tokens 64] [--reps 5] [--families ...] [--hidden H --layers L]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import mlx.core as mx
from melix_mlx.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.tools.tiny import FAMILIES, make_tiny
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

PROMPT = [(37 * i + 11) % 256 for i in range(32)]


class OracleHead:
    """The real head's forward (its cost), with drafts replaced by the known continuation.

    Its cache is the real head's cache plus one KVCache holding the token ids fed, so the
    decoder's priming, catch-up and trims apply to both; the next-next token is looked up
    from the fed context (slot convention: the head is fed t_{i+1} and predicts t_{i+2}).
    """

    def __init__(self, head: Any, script: list[int], vocab_size: int) -> None:
        self.head = head
        self.vocab_size = vocab_size
        seen = script[1:]
        self.table = {tuple(seen[:m]): seen[m] for m in range(1, len(seen))}

    def make_cache(self) -> list[Any]:
        return [*self.head.make_cache(), KVCache()]

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        logits, head_hidden = self.head(hidden, tokens, cache[:-1])
        ids = tokens.astype(mx.float32)[:, None, :, None]
        keys, _ = cache[-1].update_and_fetch(ids, ids)
        context = keys[0, 0, :, 0].astype(mx.int32).tolist()
        L = tokens.shape[1]
        before = len(context) - L
        want = [self.table.get(tuple(context[: before + i + 1]), 0) for i in range(L)]
        onehot = (mx.array(want)[:, None] == mx.arange(self.vocab_size))[None].astype(logits.dtype)
        # keep the head's logits in the graph so its forward is really evaluated
        return onehot * 100.0 + 0.0 * logits, head_hidden


def time_baseline(model: Any, n: int) -> tuple[float, dict[str, Any]]:
    start = None
    for i, _ in enumerate(generate_step(mx.array(PROMPT), model, max_tokens=n)):
        if i == 0:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (n - 1), {"target_forwards_per_token": 1.0}


def time_mtp(model: Any, head: Any, k: int, n: int) -> tuple[float, dict[str, Any]]:
    decoder = MTPDecoder(model, head, num_draft_tokens=k)
    start = None
    for i, _ in enumerate(decoder.generate(mx.array(PROMPT), n)):
        if i == 0:
            start = time.perf_counter()
    elapsed = (time.perf_counter() - start) / (n - 1)
    s = decoder.stats
    return elapsed, {
        "acceptance_rate": s["acceptance_rate"],
        "per_position_acceptance": s["per_position_acceptance"],
        "target_forwards_per_token": (s["target_forwards"] + s["replay_forwards"]) / (n - 1),
        "head_forwards_per_token": s["head_forwards"] / (n - 1),
    }


def bench_family(family: str, path: str, n: int, reps: int) -> dict[str, Any]:
    model, _, head, _ = load_with_heads(path)
    reference = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]
    oracle = OracleHead(head, PROMPT + reference, model_vocab(model))
    methods = {
        "baseline": lambda: time_baseline(model, n),
        "random_k1": lambda: time_mtp(model, head, 1, n),
        "random_k2": lambda: time_mtp(model, head, 2, n),
        "oracle_k1": lambda: time_mtp(model, oracle, 1, n),
        "oracle_k2": lambda: time_mtp(model, oracle, 2, n),
    }
    for run in methods.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in methods}
    extra: dict[str, dict[str, Any]] = {}
    names = list(methods)
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate: no fixed position bias
        for name in order:
            t, info = methods[name]()
            times[name].append(t)
            extra[name] = info
    base = statistics.median(times["baseline"])
    out: dict[str, Any] = {}
    for name in names:
        med = statistics.median(times[name])
        out[name] = {
            "ms_per_token": round(med * 1e3, 4),
            "ratio_vs_baseline": round(med / base, 3),
            **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in extra[name].items()},
        }
    return out


def model_vocab(model: Any) -> int:
    from melix_mlx.runtime.hidden import main_parts

    return main_parts(model).args.vocab_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--hidden", type=int, default=None, help="hidden size of the tiny models")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the tiny models")
    args = parser.parse_args()
    shape = {k: v for k, v in (("hidden_size", args.hidden), ("num_hidden_layers", args.layers)) if v}
    preload = os.environ.get("LD_PRELOAD", "")
    regime = "openblas (bandwidth-bound)" if "openblas" in preload else "reference BLAS (compute-bound)"
    result: dict[str, Any] = {
        "regime": regime,
        "ld_preload": preload or None,
        "device": str(mx.default_device()),
        "tokens": args.tokens,
        "reps": args.reps,
        "prompt_tokens": len(PROMPT),
        "shape": shape,
        "families": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            path = str(make_tiny(family, f"{tmp}/{family}", **shape))
            result["families"][family] = bench_family(family, path, args.tokens, args.reps)
    print(f"regime: {regime}; {args.tokens} tokens, median of {args.reps}", file=sys.stderr)
    header = f"{'family':12} {'method':10} {'ms/tok':>8} {'ratio':>6} {'accept':>7} {'fwd/tok':>8}"
    print(header, file=sys.stderr)
    for family, rows in result["families"].items():
        for name, row in rows.items():
            acc = row.get("acceptance_rate")
            acc_s = f"{acc:.3f}" if isinstance(acc, float) else "-"
            print(
                f"{family:12} {name:10} {row['ms_per_token']:8.3f} {row['ratio_vs_baseline']:6.3f} "
                f"{acc_s:>7} {row['target_forwards_per_token']:8.3f}",
                file=sys.stderr,
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
