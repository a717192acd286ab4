"""What decoding plainly inside MTPBatchGenerator costs under continuous batching, against
mlx-lm's BatchGenerator on the same loaded model: policy force_off (the head primed and
fed, every row suspended), auto disabled by a failed calibration (no head work) and, with
`--auto`, auto as `melix-fsm bench` builds it (this run's calibration at the batch size, the
family's prior, sampled rows priced at their prompts' score), with mlx-lm's run repeated as
the A/A control. `--requests-per-slot` requests per row slot
(queued requests join as rows finish), sampled or greedy, rounds in alternating order.
Reported per method: the generators' own decode tokens/s (what `melix-fsm bench` compares)
and wall-clock tokens/s from insert to the last token (prefill included), each as
ratios to mlx-lm's run of the same round. Nothing here is a test.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/bench_off_paths_batch.py --model stdlib-hybrid --batch-size 4 --temp 0.7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.runtime.sampling import make_sampler
from melix_mlx.tools.bench import Bench
from melix_mlx.tools.workloads import held_out_prompts
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.errors import CalibrationError


def run(gen: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(the generator's decode tokens/s, wall tokens/s from insert to the last token)."""
    start = time.perf_counter()
    with gen.stats() as stats:
        gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        while gen.next_generated():
            pass
    wall = time.perf_counter() - start
    return stats.generation_tps, stats.generation_tokens / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stdlib-hybrid")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--auto", action="store_true", help="also run auto, calibrated as the bench cell is")
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    cut = [replace(q, text=q.text[: args.prompt_chars]) for q in held_out_prompts(model_dir)]
    n = args.batch_size * args.requests_per_slot
    # the bench calibrates at the context these prompts reach
    bench = Bench.open(
        model_dir, max_tokens=args.max_tokens, prompts=cut, requests_per_slot=args.requests_per_slot
    )
    model, head = bench.model, bench.head
    calibration = bench.calibrate([args.batch_size], [2]) if args.auto else None
    prompts = [bench.prompts[i % len(bench.prompts)] for i in range(n)]
    slots = {"completion_batch_size": args.batch_size, "prefill_batch_size": min(args.batch_size, 8)}
    failed = CalibrationError("measurement_timeout", "not measured here")

    def mlx_lm(seed: int) -> tuple[float, float]:
        mx.random.seed(seed)
        sampler = mlx_make_sampler(temp=args.temp) if args.temp else None
        gen = BatchGenerator(model, max_tokens=args.max_tokens, sampler=sampler, **slots)
        try:
            return run(gen, prompts, args.max_tokens)
        finally:
            gen.close()

    shares: list[float] = []

    def ours(seed: int, controller: LiveController | None) -> tuple[float, float]:
        mx.random.seed(seed)
        sampler = make_sampler(temp=args.temp) if args.temp else None
        gen = MTPBatchGenerator(
            model, head, num_draft_tokens=2, max_tokens=args.max_tokens, sampler=sampler,
            controller=controller, **slots,
        )
        return run(gen, prompts, args.max_tokens)

    def auto(seed: int) -> tuple[float, float]:
        controller = bench.auto_controller(2, args.batch_size)
        out = ours(seed, controller)
        if controller is not None:
            shares.append(1.0 - controller.counters.steps_suspended / max(controller.step, 1))
        return out

    runs: dict[str, Callable[[int], tuple[float, float]]] = {
        "mlx_lm": mlx_lm,
        "force_off": lambda s: ours(s, LiveController(None, policy="force_off")),
        "disabled": lambda s: ours(s, LiveController(failed, policy="auto")),
        "mlx_lm_again": mlx_lm,
    }
    if args.auto:
        runs["auto"] = auto
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in runs if r % 2 == 0 else reversed(list(runs)):
            out[name].append(runs[name](r))
    base = out["mlx_lm"]
    summary = {
        name: {
            "decode_tok_s": round(statistics.median(d for d, _ in v), 2),
            "decode_over_mlx_lm": [round(a[0] / b[0], 3) for a, b in zip(v, base)],
            "wall_over_mlx_lm": [round(a[1] / b[1], 3) for a, b in zip(v, base)],
        }
        for name, v in out.items()
    }
    extra = {"calibration": calibration, "auto_speculated_share": shares} if args.auto else {}
    print(json.dumps({"args": vars(args), "methods": summary, **extra}))


if __name__ == "__main__":
    main()
