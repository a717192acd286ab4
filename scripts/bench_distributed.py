"""1 rank vs N ranks, with and without MTP: decode tokens/s and collective latency.

    python scripts/bench_distributed.py --model stdlib-tiny                      # 1 rank
    mlx.launch --backend ring -n 2 -- python scripts/bench_distributed.py \\
        --model stdlib-tiny --sharding pipeline                                  # 2 ranks

Every rank loads the checkpoint (sharded with mlx-lm's own sharding under a group),
then decodes the same prompts greedily: plainly (mlx-lm's `stream_generate`) and with
MTP (`mtp_stream_generate`, fixed depth, no policy), alternating the two; under a group it
also times one small all_sum (a collective's latency). Rank 0 prints one JSON object:
medians over repeats, the ratio's min-max beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

PROMPTS = ["def parse_args(argv):", "import os\nimport sys\n", "class Parser:"]


def _collective_latency(group, repeats: int = 200) -> dict[str, float]:
    """Median seconds of one all_sum of 4 bytes and of 16 KiB (a hidden state row)."""
    out = {}
    for name, n in (("all_sum_4B_s", 1), ("all_sum_16KiB_s", 4096)):
        x = mx.ones((n,), dtype=mx.float32)
        mx.eval(mx.distributed.all_sum(x, group=group))
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            samples.append(time.perf_counter() - t0)
        out[name] = statistics.median(samples)
    return out


def _interleaved(plain, mtp, repeats: int) -> dict[str, float]:
    """Plain and MTP runs alternated (drift on a shared machine hits both alike)."""
    plain_rates, mtp_rates, ratios = [], [], []
    for _ in range(repeats):
        rates = []
        for run in (plain, mtp):
            t0 = time.perf_counter()
            count = run()
            rates.append(count / (time.perf_counter() - t0))
        plain_rates.append(rates[0])
        mtp_rates.append(rates[1])
        ratios.append(rates[1] / rates[0])
    return {
        "plain_tps": round(statistics.median(plain_rates), 1),
        "mtp_tps": round(statistics.median(mtp_rates), 1),
        "mtp_speedup": round(statistics.median(ratios), 3),
        "speedup_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def main() -> None:
    from melix_mlx.generate import mtp_stream_generate
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.runtime.distributed import load_sharded
    from mlx_lm.generate import stream_generate

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="stdlib-tiny")
    parser.add_argument("--sharding", choices=["tensor", "pipeline"], default="pipeline")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    group = mx.distributed.init()
    model, tokenizer, head, _ = load_sharded(resolve_model(args.model), args.sharding, group)

    def plain() -> int:
        return sum(
            len(list(stream_generate(model, tokenizer, p, max_tokens=args.max_tokens))) for p in PROMPTS
        )

    accepted = [0, 0]

    def mtp() -> int:
        n = 0
        for p in PROMPTS:
            stats = None
            for response in mtp_stream_generate(
                model, tokenizer, p, head, max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens
            ):
                n += 1
                stats = response.stats
            accepted[0] += stats["accepted"]
            accepted[1] += stats["proposed"]
        return n

    plain()  # warm up both paths once
    mtp()
    accepted[:] = [0, 0]
    timing = _interleaved(plain, mtp, args.repeats)
    result = {
        "model": args.model,
        "ranks": group.size(),
        "sharding": args.sharding if group.size() > 1 else None,
        "num_draft_tokens": args.num_draft_tokens,
        "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS),
        **timing,
        "acceptance_rate": round(accepted[0] / max(accepted[1], 1), 3),
    }
    if group.size() > 1:
        latency = _collective_latency(group)
        result.update({name.removesuffix("_s") + "_us": round(v * 1e6, 1) for name, v in latency.items()})
    if group.rank() == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
