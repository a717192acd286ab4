"""What decoding plainly inside MTPDecoder costs, by how speculation is off, against
mlx-lm's generate_step: policy force_off (the head primed, the row in batch form, pending
head pairs flushed every 32 steps) and auto disabled by a failed calibration (no head
work), with mlx-lm's run repeated as the A/A control. Single sequence, greedy, k = 2, the
widened `stdlib-hybrid-wide`, 3 held-out prompts cut to 300 characters, 3 rounds in
alternating order; decode tokens/s from the first token. Nothing here is a test.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/bench_off_paths.py [max_tokens]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import mlx.core as mx
from melix_mlx.decoding.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.tools.workloads import held_out_prompts
from mlx_lm.generate import generate_step

from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.errors import CalibrationError


def decode_rate(tokens: Iterable[object]) -> float:
    """Tokens per second from the first token to the last."""
    start, n = 0.0, 0
    for _ in tokens:
        n += 1
        if n == 1:
            start = time.perf_counter()
    return (n - 1) / (time.perf_counter() - start)


def main() -> None:
    max_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    model, tokenizer, head, _ = load_with_heads(resolve_model("stdlib-hybrid-wide"))
    prompts = [tokenizer.encode(p.text[:300]) for p in held_out_prompts()[:3]]

    def mlx_lm(prompt: list[int]) -> float:
        return decode_rate(generate_step(mx.array(prompt), model, max_tokens=max_tokens))

    def ours(prompt: list[int], controller: LiveController) -> float:
        decoder = MTPDecoder(model, head, num_draft_tokens=2, controller=controller)
        return decode_rate(decoder.generate(mx.array(prompt), max_tokens))

    failed = CalibrationError("measurement_timeout", "not measured here")
    runs: dict[str, Callable[[list[int]], float]] = {
        "mlx_lm": mlx_lm,
        "force_off": lambda p: ours(p, LiveController(None, policy="force_off")),
        "disabled": lambda p: ours(p, LiveController(failed, policy="auto")),
        "mlx_lm_again": mlx_lm,
    }
    out: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(3):
        for prompt in prompts:
            for name in runs if round_ % 2 == 0 else reversed(list(runs)):
                out[name].append(runs[name](prompt))
    base = out["mlx_lm"]
    print(
        json.dumps(
            {
                name: {
                    "tok_s": round(statistics.median(v), 3),
                    "over_mlx_lm": [round(a / b, 3) for a, b in zip(v, base)],
                }
                for name, v in out.items()
            }
        )
    )


if __name__ == "__main__":
    main()
