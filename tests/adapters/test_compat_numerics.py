"""Numerics per dtype: how often greedy MTP output differs from mlx-lm's, and why.

A verify scores k + 1 positions in one forward and writes their keys in one step;
mlx-lm scores and writes one position per forward. The two shapes round differently,
and in bfloat16 (8 mantissa bits) the difference, compounded through the cache, can
change a greedy token. The tests measure, per dtype, the share of runs whose tokens
differ from mlx-lm's `generate_step` on the same loaded model (recorded with
`record_property`, printed with -s) and assert what the README states:
- float32, float16, 4- and 8-bit weights: no run differs;
- bfloat16: runs may differ (measured, reported); the same runs in float32 do not (so a
  difference is the dtype's rounding, not the algorithm), and sampled bfloat16 output follows
  mlx-lm's distribution (a G-test on the joint of the first two tokens, the second from
  a verify, as tests/adapters/test_decode_sampling.py does in float32).
The sweep over both embedded checkpoints, every dtype and held-out prompts is
@pytest.mark.slow; the default run keeps one representative cell per claim.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from decode_refs import mtp
from melix_mlx.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.runtime.sampling import make_sampler, normalize_logits, params_of, probabilities
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from scripted_head import ScriptedHead
from test_decode_sampling import ALPHA, g_test

IDENTICAL = ("float32", "float16", "q4", "q8")  # the README's unqualified identity claim


@dataclass
class Mismatches:
    runs: int = 0
    differing: int = 0
    gaps: list[float] = field(default_factory=list)  # mlx-lm's top-2 log-prob gap where we diverge

    def __str__(self) -> str:
        return f"{self.differing}/{self.runs} runs differ (top-2 gaps at divergence {self.gaps})"


def cast(model: Any, head: Any, dtype: str) -> None:
    """The loaded model in `dtype`: float16 / bfloat16, or q4 / q8 main-model weights."""
    if dtype in ("float16", "bfloat16"):
        model.set_dtype(getattr(mx, dtype))
        head.set_dtype(getattr(mx, dtype))
    elif dtype in ("q4", "q8"):
        nn.quantize(model, group_size=32, bits=int(dtype[1:]))
    mx.eval(model.parameters(), head.parameters())


HeadFor = Callable[[list[int], list[int]], Any]  # (prompt, mlx-lm's tokens) -> the head to draft with


def measure(model: Any, head_for: HeadFor, prompts, n: int, depths) -> Mismatches:
    """Greedy MTP vs mlx-lm's generate_step, every prompt at every depth."""
    out = Mismatches()
    for prompt in prompts:
        steps = [(int(t), lp) for t, lp in generate_step(mx.array(prompt), model, max_tokens=n)]
        want = [t for t, _ in steps]
        head = head_for(prompt, want)
        for k in depths:
            got, _ = mtp(model, head, prompt, n, k)
            out.runs += 1
            if got != want:
                out.differing += 1
                i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
                top2 = mx.sort(steps[i][1].astype(mx.float32))[-2:].tolist()
                out.gaps.append(round(top2[1] - top2[0], 4))
    return out


QUICK_PROMPTS = ["import os\n", "class Parser:\n    def __init__(self"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_mismatch_rate_quick(dtype: str, record_property) -> None:
    """One representative cell: the embedded hybrid checkpoint with its own head, k = 2."""
    model, tokenizer, head, _ = load_with_heads(resolve_model("stdlib-hybrid"))
    cast(model, head, dtype)
    prompts = [tokenizer.encode(text) for text in QUICK_PROMPTS]
    result = measure(model, lambda prompt, want: head, prompts, 32, (2,))
    record_property(f"greedy_mismatch_stdlib-hybrid_{dtype}", str(result))
    print(f"stdlib-hybrid {dtype}: {result}")
    if dtype in IDENTICAL:
        assert result.differing == 0, str(result)
    else:  # measured and reported, not promised: the float32 cell is the control
        assert result.runs == len(QUICK_PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "q4", "q8"])
@pytest.mark.parametrize("name", ["stdlib-tiny", "stdlib-hybrid"])
def test_greedy_mismatch_sweep(name: str, dtype: str, record_property) -> None:
    """The embedded trained checkpoints with their own heads on held-out prompts."""
    from melix_mlx.tools.workloads import held_out_prompts

    model, tokenizer, head, _ = load_with_heads(resolve_model(name))
    cast(model, head, dtype)
    prompts = [tokenizer.encode(p.text) for p in held_out_prompts(resolve_model(name), per_workload=2)]
    try:
        result = measure(model, lambda prompt, want: head, prompts, 48, (1, 2))
    except RuntimeError as exc:  # mlx's CPU expert gather (MoE) runs float32 only
        if "GatherMM" in str(exc):
            pytest.skip(f"mlx-lm itself cannot run this model here: {exc}")
        raise
    record_property(f"greedy_mismatch_{name}_{dtype}", str(result))
    print(f"{name} {dtype}: {result}")
    if dtype in IDENTICAL:
        assert result.differing == 0, str(result)


# -- sampled output in bfloat16 follows mlx-lm's distribution ------------------------------
PROMPT = [72]
SAMPLES = 1200


@pytest.fixture(scope="module")
def bf16_setup(tiny_checkpoint):
    model, _, _, _ = load_with_heads(tiny_checkpoint("mimo", num_hidden_layers=1, max_window_layers=1))
    model.set_dtype(mx.bfloat16)
    sampler = make_sampler(temp=1.0, top_k=4)
    params = params_of(sampler)

    def mlx_lm_dist(tokens: list[int]) -> mx.array:
        """mlx-lm's next-token distribution: a cached one-token forward per position."""
        cache = make_prompt_cache(model)
        logits = None
        for t in tokens:
            logits = model(mx.array([[t]]), cache=cache)
        return probabilities(normalize_logits(logits[0, -1].astype(mx.float32)), params)

    p1 = mlx_lm_dist(PROMPT)
    joint: dict[tuple[int, int], float] = {}
    scripts = []
    for t1 in range(VOCAB_SIZE):
        if p1[t1].item() > 0:
            p2 = mlx_lm_dist(PROMPT + [t1])
            for t2 in range(VOCAB_SIZE):
                if p2[t2].item() > 0:
                    joint[(t1, t2)] = p1[t1].item() * p2[t2].item()
            scripts.append(PROMPT + [t1, int(mx.argmax(p2).item())])
    head = ScriptedHead(scripts, VOCAB_SIZE, main_parts(model).args.hidden_size, confidence=2.0)
    return model, head, sampler, joint


def test_bfloat16_sampled_follows_mlx_lm_distribution(bf16_setup) -> None:
    model, head, sampler, joint = bf16_setup
    mx.random.seed(20261203)
    counts: Counter = Counter()
    accepted = rejected = 0
    for _ in range(SAMPLES):
        decoder = MTPDecoder(model, head, num_draft_tokens=1, sampler=sampler)
        t1, t2 = (t for t, _, _ in decoder.generate(mx.array(PROMPT), 2))
        counts[(t1, t2)] += 1
        accepted += decoder.stats["accepted"]
        rejected += decoder.stats["rejected"]
    assert set(counts) <= set(joint), f"pairs mlx-lm can never sample: {set(counts) - set(joint)}"
    assert accepted > SAMPLES // 10 and rejected > SAMPLES // 10  # both branches ran
    assert g_test(counts, joint) > ALPHA
