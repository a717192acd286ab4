"""Where the single-sequence decoder evaluates its head's pass over the prompt (the prime).

    python benchmarks/bench_prime_placement.py --model stdlib-hybrid --regime reference --repeats 10

Since the tenth round `MTPDecoder` evaluates the prime before the first token, as the
batched generator always did; before, it was built lazily and evaluated in the first
cycle, so one head layer's pass over the prompt landed in the generation phase. This
moves work between the two phases and must not change the whole request's time: the
script runs forced-on MTP both ways and mlx-lm's `stream_generate`, alternating (ABBA),
greedy, identical tokens asserted, and prints one JSON object: each variant's generation
tokens/s, prompt tokens/s and whole-request time against mlx-lm's (median, min-max).

`lazy` reproduces the old placement without old code: its controller is forced on but
reads as suspended at the decoder's second look at `speculating` (the first is the
start's lifecycle reconcile, the second the prime's evaluation check), so the decoder
leaves the prime for the first cycle. The script fails if the lazy run did not read
`speculating` at least twice before its first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from melix_mlx.commands.bench import reexec_in_regime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-hybrid")
    parser.add_argument("--regime", choices=("reference", "openblas"), default="reference")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-draft-tokens", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    reexec_in_regime(args.regime)

    import mlx.core as mx
    from melix_mlx.generate import mtp_stream_generate
    from melix_mlx.loading import load_with_heads
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools.workloads import held_out_prompts
    from mlx_lm import stream_generate

    from melix_fsm.policy.controller import LiveController

    class PrimeInFirstCycle(LiveController):
        """Forced on; reads as suspended at the second look only (see the module docstring)."""

        reads = 0

        @property
        def speculating(self) -> bool:
            self.reads += 1
            return self.reads != 2

    model_dir = resolve_model(args.model)
    model, tokenizer, head, _ = load_with_heads(model_dir)
    prompts = [tokenizer.encode(p.text) for p in held_out_prompts(model_dir)]
    k = args.num_draft_tokens

    def run(kind: str, prompt: list[int], seed: int) -> tuple[float, float, float, list[int]]:
        mx.random.seed(seed)
        start = time.perf_counter()
        if kind == "mlx_lm":
            responses = stream_generate(model, tokenizer, prompt, args.max_tokens)
        else:
            cls = PrimeInFirstCycle if kind == "lazy" else LiveController
            controller = cls(None, policy="force_on", depth=k, batch_size=1)
            options = {"max_tokens": args.max_tokens, "num_draft_tokens": k, "controller": controller}
            responses = mtp_stream_generate(model, tokenizer, prompt, head, **options)
        tokens, last = [], None
        for last in responses:
            tokens.append(last.token)
        if kind == "lazy" and controller.reads < 2:
            raise SystemExit("the lazy variant no longer reaches the prime's check: update this script")
        return last.generation_tps, last.prompt_tps, time.perf_counter() - start, tokens

    kinds = ("mlx_lm", "eager", "lazy")
    runs: dict[str, list[tuple[float, float, float, list[int]]]] = {kind: [] for kind in kinds}
    for r in range(args.repeats):
        prompt = prompts[r % len(prompts)]
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            runs[kind].append(run(kind, prompt, r))
        tokens = {kind: runs[kind][-1][3] for kind in kinds}
        if len({tuple(t) for t in tokens.values()}) != 1:
            raise SystemExit(f"repeat {r}: the three runs' tokens differ")

    def ratios(num: str, den: str, index: int) -> dict[str, float]:
        values = [a[index] / b[index] for a, b in zip(runs[num], runs[den])]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out = {"model": args.model, "regime": args.regime, "k": k, "repeats": args.repeats}
    for kind in ("eager", "lazy"):
        out[kind] = {
            "generation_over_mlx_lm": ratios(kind, "mlx_lm", 0),
            "prompt_over_mlx_lm": ratios(kind, "mlx_lm", 1),
            "request_speed_over_mlx_lm": ratios("mlx_lm", kind, 2),  # mlx-lm's time / ours
        }
    out["eager_over_lazy"] = {
        "generation": ratios("eager", "lazy", 0),
        "request_speed": ratios("lazy", "eager", 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
