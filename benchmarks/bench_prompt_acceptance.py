"""Can a request's own prompt predict the acceptance its decode will see?

A measurement behind a design choice, not a test: `auto` admits a sampled batch on the
family's greedy acceptance prior, and sampling lowers acceptance. The head is already fed
every prompt pair (h_j, t_{j+1}) to prime it, so its draft distribution q at the prompt's
last N positions costs one vocabulary projection more, and the target's p there another.
This script scores those positions teacher-forced, at the request's own sampling settings:
- greedy: the share of positions where argmax q == argmax p;
- sampled at T: mean sum_x min(p_T(x), q_T(x)), the exact probability that speculative
  sampling accepts a draft drawn from q_T,
and compares them with the per-draft acceptance the decoder then measures (k = 1, forced
on) over `--max-tokens` tokens of the same prompt, greedy and at each T.

Usage:
    python benchmarks/bench_prompt_acceptance.py [--model stdlib-hybrid] [--last 32]
        [--prompt-tokens 200] [--max-tokens 96] [--temps 0.7 1.0] [--seeds 3]

Prints one JSON line per prompt, then a summary line (means over prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics

import mlx.core as mx
from melix_mlx.decoding.generate import mtp_stream_generate
from melix_mlx.loading.loaders import load_with_heads
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.runtime.prefill import prefill_with_hidden
from melix_mlx.runtime.sampling import SamplingParams, make_sampler, normalize_logits, probabilities
from melix_mlx.tools.workloads import held_out_prompts
from mlx_lm.models.cache import make_prompt_cache


def prompt_scores(model, head, ids: list[int], last: int, temps: list[float]) -> dict[str, float]:
    """Teacher-forced acceptance over the prompt's last `last` head slots."""
    _, hiddens = prefill_with_hidden(model, mx.array(ids), make_prompt_cache(model))
    n = hiddens.shape[0]
    # pair j = (h_j, t_{j+1}) predicts t_{j+2}; the target predicts t_{j+2} at position j + 1
    out = head.trunk(hiddens[None, : n - 1], mx.array(ids[1:n])[None], head.make_cache())
    q = normalize_logits(head.logits(out[:, n - 2 - last : n - 2])[0])
    p = normalize_logits(main_parts(model).lm_head(hiddens[None, n - 1 - last : n - 1])[0])
    scores = {"greedy": (mx.argmax(q, -1) == mx.argmax(p, -1)).astype(mx.float32).mean().item()}
    for temp in temps:
        params = SamplingParams(temp=temp)
        overlap = mx.minimum(probabilities(p, params), probabilities(q, params)).sum(-1)
        scores[f"T={temp}"] = overlap.mean().item()
    return scores


def decoded_acceptance(
    model, tokenizer, head, ids: list[int], temp: float, max_tokens: int, seed: int
) -> float:
    mx.random.seed(seed)
    stats: dict = {}
    for response in mtp_stream_generate(
        model, tokenizer, mx.array(ids), head, max_tokens, num_draft_tokens=1, sampler=make_sampler(temp)
    ):
        stats = response.stats
    return float(stats["acceptance_rate"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="stdlib-hybrid")
    ap.add_argument("--last", type=int, default=32, help="prompt positions scored")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="cut each held-out prompt to N tokens")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temps", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--seeds", type=int, default=3, help="decodes per sampled temperature")
    args = ap.parse_args()
    model, tokenizer, head, _ = load_with_heads(args.model)
    rows = []
    for prompt in held_out_prompts():
        ids = tokenizer.encode(prompt.text)[: args.prompt_tokens]
        row: dict = {
            "workload": prompt.workload,
            "prompt": prompt_scores(model, head, ids, args.last, args.temps),
        }
        decoded = {"greedy": decoded_acceptance(model, tokenizer, head, ids, 0.0, args.max_tokens, 0)}
        for temp in args.temps:
            runs = [
                decoded_acceptance(model, tokenizer, head, ids, temp, args.max_tokens, s)
                for s in range(args.seeds)
            ]
            decoded[f"T={temp}"] = statistics.fmean(runs)
        row["decoded"] = decoded
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = ["greedy", *(f"T={t}" for t in args.temps)]
    summary = {
        key: {
            "prompt": round(statistics.fmean(r["prompt"][key] for r in rows), 3),
            "decoded": round(statistics.fmean(r["decoded"][key] for r in rows), 3),
            "corr": round(
                statistics.correlation([r["prompt"][key] for r in rows], [r["decoded"][key] for r in rows]), 2
            ),
        }
        for key in keys
    }
    print(json.dumps({"model": args.model, "last": args.last, "summary": summary}))


if __name__ == "__main__":
    main()
