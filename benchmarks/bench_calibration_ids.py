"""What the calibration's token ids do to its price of a verify, on a many-expert MoE.

Rules of this script:
- A DeepSeek-V3-layout checkpoint from make-tiny, widened (hidden 512, experts 512 wide,
  4 layers) with `--experts` routed experts of which `--top` are chosen per token, loaded
  with its head; a 64-token prompt of distinct ids in each of `--batch` rows is prefilled.
- Four forwards are timed interleaved, round after round (3 warm-up rounds dropped), each
  behind its own sync with the cache put back after it: a 1-token step and a 3-token
  verify (k = 2) fed one repeated id in every row and position (what the calibration fed
  before) and the same two fed distinct ids (what it feeds now:
  melix_mlx.runtime.calibrate.token_ids). Medians; the figure is t_verify / t_1 each way.
- The regime is the environment's: preload OpenBLAS with OPENBLAS_NUM_THREADS=1 for the
  bandwidth-bound one (a MoE's expert weights then cost what reading them costs).

Usage: python benchmarks/bench_calibration_ids.py --experts 64 --top 8 --batch 1 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import mlx.core as mx
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime import rollback
from melix_mlx.runtime.hidden import forward_with_hidden
from melix_mlx.tools.bench_results import regime
from melix_mlx.tools.tiny import make_tiny
from mlx_lm.models.cache import make_prompt_cache


def measure(model: Any, batch: int, rounds: int) -> dict[str, float]:
    vocab = model.args.vocab_size
    prompt = mx.random.randint(2, vocab, (batch, 64), key=mx.random.key(0))
    cache = make_prompt_cache(model)
    _, hidden = forward_with_hidden(model, prompt, cache)
    mx.eval(hidden, [c.state for c in rollback.leaves(cache)])
    start = rollback.mark(cache)

    def timed(tokens: mx.array) -> float:
        t0 = time.perf_counter()
        logits, h = forward_with_hidden(model, tokens, cache)
        mx.eval(logits, h)
        elapsed = time.perf_counter() - t0
        rollback.restore(cache, start)
        return elapsed

    samples: dict[str, list[float]] = {
        "t_1 same": [],
        "t_verify same": [],
        "t_1 distinct": [],
        "t_verify distinct": [],
    }
    for r in range(rounds + 3):
        inputs = {
            "t_1 same": mx.ones((batch, 1), mx.int32),
            "t_verify same": mx.ones((batch, 3), mx.int32),
            "t_1 distinct": mx.random.randint(2, vocab, (batch, 1), key=mx.random.key(100 + r)),
            "t_verify distinct": mx.random.randint(2, vocab, (batch, 3), key=mx.random.key(200 + r)),
        }
        for name, tokens in inputs.items():
            elapsed = timed(tokens)
            if r >= 3:
                samples[name].append(elapsed)
    ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    return {
        **{f"{name} ms": value for name, value in ms.items()},
        "verify_over_t1_same": ms["t_verify same"] / ms["t_1 same"],
        "verify_over_t1_distinct": ms["t_verify distinct"] / ms["t_1 distinct"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=22)
    args = parser.parse_args()
    sizes = {
        "hidden_size": 512,
        "moe_intermediate_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
    }
    sizes |= {"n_routed_experts": args.experts, "num_experts_per_tok": args.top}
    sizes |= {"num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 256, "q_lora_rank": 256}
    result: dict[str, Any] = {"regime": regime(), "args": vars(args), "batch": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model, _, _, _ = load_with_heads(str(make_tiny("deepseek_v3", f"{tmp}/moe", **sizes)))
        for batch in args.batch:
            figures = measure(model, batch, args.rounds)
            result["batch"][str(batch)] = figures
            print(
                f"experts {args.experts} top {args.top} batch {batch}: t_verify / t_1 one repeated id "
                f"{figures['verify_over_t1_same']:.2f}, "
                f"distinct ids {figures['verify_over_t1_distinct']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
