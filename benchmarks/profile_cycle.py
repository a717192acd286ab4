"""Where a speculative cycle's time goes beyond the forwards the ideal prices, per family.

Rules of this script:
- The setting is bench_controlled_acceptance.py's: the family's tiny checkpoint
  (`--hidden` / `--layers` widen it, `--scale F` multiplies every width), its own head
  behind the controlled draft source (p = 0.8), k = 2, batch 1, one sequence.
- Ops: the primitives of one cycle's graph (counted from `mx.export_to_dot` of what the
  engine hands to `mx.async_eval`, mid-run) against the calibrated forwards' graphs, the
  verify plus k head steps; the difference is what the cycle adds (acceptance, the
  recurrent state selection, the head's catch-up over the k + 1 verified slots).
- Time: interleaved, round after round, on the process's CPU clock and on the main
  thread's (the thread that builds and dispatches every op; the rest of the process's CPU
  is mlx's worker, the compute): the calibrated forwards run one after another, each
  behind its own sync (`trio`: the verify and k head steps, the ideal's cost), one decode
  of the engine per round (`cycle`: its CPU per cycle), mlx-lm's own loop
  (`plain`: per token) and the calibrated one-token forward (`t_1`). The head's
  catch-up (k + 1 slots in the verify's form, one slot projected) is timed beside the
  calibrated one-slot head step.
- Nothing here is a pass/fail figure: it says where to look. On a shared machine the CPU
  clocks move less than the wall clock, not nothing (two busy threads cost more CPU than
  one), and the fastest wall-clock run is the least disturbed; the load average is printed.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
      python benchmarks/profile_cycle.py step3p5 glm_moe_dsa
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import re
import statistics
import tempfile
import time
from typing import Any

import mlx.core as mx
from bench_controlled_acceptance import scaled_sizes
from melix_mlx.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime import absorbed_mla, rollback
from melix_mlx.runtime.calibrate import build_forwards
from melix_mlx.runtime.engine_head import head_at
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.tools.controlled_draft import ControlledDraft
from melix_mlx.tools.tiny import make_tiny
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

PROMPT = "def parse(line):\n    key, _, value = line.partition('=')\n"
K = 2


def ops(*arrays: Any) -> collections.Counter[str]:
    """The primitives of the graph behind `arrays`, by name."""
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return collections.Counter(re.findall(r'label ="?([A-Za-z_]+)', out.getvalue()))


def graph_ops(model: Any, draft: Any, prompt: list[int], forwards: tuple) -> dict[str, Any]:
    """Op counts of the calibrated forwards and of one mid-run cycle."""
    counted: dict[str, collections.Counter[str]] = {}
    real_eval, real_async = mx.eval, mx.async_eval
    for name, fn in zip(("t1", "verify", "head"), forwards):

        def counting_eval(*arrays: Any, _name: str = name) -> None:
            counted[_name] = ops(*arrays)
            real_eval(*arrays)

        mx.eval = counting_eval
        try:
            fn()
        finally:
            mx.eval = real_eval
    cycles: list[collections.Counter[str]] = []

    def counting_async(*arrays: Any) -> None:
        cycles.append(ops(*arrays))
        real_async(*arrays)

    mx.async_eval = counting_async
    try:
        for _ in MTPDecoder(model, draft, num_draft_tokens=K).generate(mx.array(prompt), 24):
            pass
    finally:
        mx.async_eval = real_async
    priced = counted["verify"] + sum((counted["head"] for _ in range(K)), collections.Counter())
    cycle = cycles[len(cycles) // 2]
    extra = cycle.copy()
    extra.subtract(priced)
    return {
        "t1": sum(counted["t1"].values()),
        "priced": sum(priced.values()),
        "cycle": sum(cycle.values()),
        "extra": {k: v for k, v in sorted(extra.items(), key=lambda kv: -kv[1]) if v},
    }


def timings(model: Any, draft: Any, head: Any, prompt: list[int], n: int, rounds: int) -> dict[str, Any]:
    """Per piece, interleaved round after round: the median CPU ms of the process and of the
    main thread, and the fastest wall-clock ms (the least-disturbed run on a shared machine)."""
    head_cache = draft.make_cache()
    fn_1, fn_verify, fn_head = build_forwards(
        model, draft, k=K, prompt_len=len(prompt) + n // 2, head_cache=head_cache
    )
    cache = make_prompt_cache(model)
    _, hidden = forward_with_hidden(model, mx.arange(1, len(prompt) + n // 2 + 1)[None], cache)
    block, tokens, kept = hidden[:, -(K + 1) :], mx.ones((1, K + 1), mx.uint32), mx.array([1])
    mx.eval(block)

    def fn_catch_up() -> None:  # the engine's catch-up: verify-shaped, one slot projected
        marked = absorbed_mla.arm(rollback.leaves(head_cache))
        logits, out = head_at(draft, block, tokens, head_cache, kept)
        absorbed_mla.disarm(marked)
        mx.eval(mx.argmax(logits, axis=-1), out)
        rollback.trim_all(head_cache, K + 1)

    def clocks() -> tuple[float, ...]:
        return time.process_time(), time.thread_time(), time.perf_counter()

    def timed(fn: Any) -> Any:
        def run() -> tuple[float, ...]:
            start = clocks()
            fn()
            return tuple(b - a for a, b in zip(start, clocks()))

        return run

    def trio() -> None:
        fn_verify()
        for _ in range(K):
            fn_head()

    def per_step(steps: Any, count: Any) -> tuple[float, ...]:
        """Time per step after the first token (the prefill and the decoder's setup left out)."""
        next(steps)
        start = clocks()
        for _ in steps:
            pass
        return tuple((b - a) / count() for a, b in zip(start, clocks()))

    def cycle() -> tuple[float, ...]:
        decoder = MTPDecoder(model, draft, num_draft_tokens=K)
        return per_step(decoder.generate(mx.array(prompt), n), lambda: decoder.stats["cycles"])

    def plain() -> tuple[float, ...]:
        return per_step(generate_step(mx.array(prompt), model, max_tokens=n), lambda: n - 1)

    pieces = {
        "t_1": timed(fn_1),
        "trio": timed(trio),
        "catch_up": timed(fn_catch_up),
        "head": timed(fn_head),
        "cycle": cycle,
        "plain": plain,
    }
    samples: dict[str, list[tuple[float, ...]]] = {name: [] for name in pieces}
    for r in range(rounds + 1):
        for name, fn in pieces.items():
            measured = fn()
            if r:  # the first round warms up
                samples[name].append(measured)
    return {
        name: [
            *(statistics.median(s[i] for s in values) * 1e3 for i in (0, 1)),
            min(s[2] for s in values) * 1e3,
        ]
        for name, values in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="+")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--scale", type=int, default=None, help="every width x F")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shape = {k: v for k, v in (("hidden_size", args.hidden), ("num_hidden_layers", args.layers)) if v}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            sizes = {**scaled_sizes(family, args.scale), **shape} if args.scale else shape
            model, tokenizer, head, _ = load_with_heads(str(make_tiny(family, f"{tmp}/{family}", **sizes)))
            prompt = tokenizer.encode(PROMPT)
            script = prompt + [
                t for t, _ in generate_step(mx.array(prompt), model, max_tokens=args.tokens + 10)
            ]
            draft = ControlledDraft(head, [script], main_parts(model).args.vocab_size, 0.8, seed=0)
            forwards = build_forwards(model, draft, k=K, prompt_len=len(prompt))
            counts = graph_ops(model, draft, prompt, forwards)
            load = os.getloadavg()[0]
            t = timings(model, draft, head, prompt, args.tokens, args.rounds)
            print(
                f"{family}: ops t_1 {counts['t1']}, verify + {K} head steps {counts['priced']}, cycle "
                f"{counts['cycle']} ({counts['cycle'] / counts['priced'] - 1:+.1%}): {counts['extra']}"
            )
            print(
                f"  ms, process CPU | main-thread CPU | fastest wall (load {load:.2f} -> "
                f"{os.getloadavg()[0]:.2f}): "
                + ", ".join(f"{name} {v[0]:.2f} | {v[1]:.2f} | {v[2]:.2f}" for name, v in t.items())
            )
            print(
                "  cycle / trio "
                + " | ".join(f"{t['cycle'][i] / t['trio'][i]:.2f}" for i in range(3))
                + "; plain per token / t_1 "
                + " | ".join(f"{t['plain'][i] / t['t_1'][i]:.2f}" for i in range(3))
                + f"; catch-up / head step {t['catch_up'][0] / t['head'][0]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
