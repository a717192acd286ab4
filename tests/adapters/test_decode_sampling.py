"""Sampled MTP decoding has the target's distribution, and a wrong rule is caught.

Setup: a 1-layer tiny mimo model, prompt [72], mlx-lm sampling with temp 1 and top_k 4
(so every position has 4 possible tokens and the joint of the first two tokens has 16
cells). The first token t1 comes from the prefill, the second t2 from the first
speculative cycle (k = 1): a draft from the head's q, accepted with min(1, p/q), else a
draw from the residual. The exact target joint p(t1) p(t2 | t1) is computed from the
model with the sampler's own filters (melix_mlx.runtime.sampling.probabilities).

The head is a scripted test double (scripted_head.py) with a soft q: mass ~0.6 on the
target's most likely t2 and the rest on tokens the target may or may not allow, so
accepted drafts, rejected drafts and the residual all occur.

Statistic: a G-test of the observed (t1, t2) counts against the exact joint, cells with
expected count < 5 merged. Runs use fixed mx.random seeds, so each test is
deterministic; over the choice of seed, the correct decoder fails the goodness-of-fit
test with probability alpha = 1e-3 (the test's false-failure rate). The wrong-rule
tests require p < 1e-3 with the same statistic.
"""

from __future__ import annotations

import math
from collections import Counter

import melix_mlx.runtime.engine as engine_mod
import mlx.core as mx
import pytest
from melix_mlx.decode import MTPDecoder
from melix_mlx.generate import mtp_stream_generate
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.runtime.sampling import make_sampler, normalize_logits, params_of, probabilities
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from scripted_head import ScriptedHead

ALPHA = 1e-3
PROMPT = [72]
SAMPLES = 1500


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for the lower function P
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if term < total * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300  # continued fraction for Q (modified Lentz)
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = d if abs(d) > tiny else tiny
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def g_test(observed: Counter, expected_p: dict[tuple[int, int], float]) -> float:
    """p-value of a G-test; an observation outside the support has p-value 0."""
    n = sum(observed.values())
    if not set(observed) <= set(expected_p):
        return 0.0  # a pair the target can never produce
    cells: list[tuple[float, float]] = []
    rest_o, rest_e = 0.0, 0.0
    for cell, p in expected_p.items():
        if n * p >= 5:
            cells.append((observed.get(cell, 0), n * p))
        else:  # sparse cells are merged into one
            rest_o += observed.get(cell, 0)
            rest_e += n * p
    if rest_e > 0:
        cells.append((rest_o, rest_e))
    g = 2 * sum(o * math.log(o / e) for o, e in cells if o > 0)
    return chi2_sf(g, len(cells) - 1)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    from melix_mlx.loading import load_with_heads

    model, tokenizer, _, _ = load_with_heads(
        tiny_checkpoint("mimo", num_hidden_layers=1, max_window_layers=1)
    )
    sampler = make_sampler(temp=1.0, top_k=4)
    params = params_of(sampler)

    def dist(tokens: list[int]) -> mx.array:
        return probabilities(normalize_logits(model(mx.array([tokens]))[0, -1]), params)

    p1 = dist(PROMPT)
    joint: dict[tuple[int, int], float] = {}
    scripts = []
    for t1 in range(VOCAB_SIZE):
        if p1[t1].item() > 0:
            p2 = dist(PROMPT + [t1])
            for t2 in range(VOCAB_SIZE):
                if p2[t2].item() > 0:
                    joint[(t1, t2)] = p1[t1].item() * p2[t2].item()
            scripts.append(PROMPT + [t1, int(mx.argmax(p2).item())])
    head = ScriptedHead(scripts, VOCAB_SIZE, main_parts(model).args.hidden_size, confidence=2.0)
    return model, tokenizer, head, sampler, joint


def draw_pairs(setup, n: int, seed: int) -> tuple[Counter, dict]:
    model, _, head, sampler, _ = setup
    mx.random.seed(seed)
    counts: Counter = Counter()
    totals = Counter()
    for _ in range(n):
        decoder = MTPDecoder(model, head, num_draft_tokens=1, sampler=sampler)
        t1, t2 = (t for t, _, _ in decoder.generate(mx.array(PROMPT), 2))
        counts[(t1, t2)] += 1
        totals.update({"accepted": decoder.stats["accepted"], "rejected": decoder.stats["rejected"]})
    return counts, totals


def test_joint_of_first_two_tokens(setup) -> None:
    joint = setup[4]
    assert len(joint) == 16 and math.isclose(sum(joint.values()), 1.0, rel_tol=1e-5)
    counts, totals = draw_pairs(setup, SAMPLES, seed=20261202)
    assert set(counts) <= set(joint), f"impossible pairs drawn: {set(counts) - set(joint)}"
    # both branches of the rule ran many times
    assert totals["accepted"] > SAMPLES // 10 and totals["rejected"] > SAMPLES // 10
    assert g_test(counts, joint) > ALPHA


def _accept_all(drafts, q, logprobs, params):
    """Wrong: take every draft, then a bonus token from p."""
    k = drafts.shape[0]
    p = probabilities(logprobs, params)
    return mx.array(k, mx.int32), mx.random.categorical(mx.log(p[k]))


def _resample_from_p(drafts, q, logprobs, params):
    """Wrong: the right acceptance test, but a rejection redraws from p, not the residual."""
    k = drafts.shape[0]
    p = probabilities(logprobs, params)
    idx = drafts.astype(mx.int32)[:, None]
    p_d = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    a = mx.cumprod((mx.random.uniform(shape=(k,)) * q_d < p_d).astype(mx.int32)).sum()
    return a, mx.random.categorical(mx.log(mx.take(p, a, axis=0)))


@pytest.mark.parametrize("wrong_rule", [_accept_all, _resample_from_p], ids=["accept_all", "resample_from_p"])
def test_wrong_acceptance_rule_is_detected(setup, wrong_rule, monkeypatch) -> None:
    monkeypatch.setattr(engine_mod, "accept_sampled", wrong_rule)
    counts, _ = draw_pairs(setup, 500, seed=7)
    assert g_test(counts, setup[4]) < ALPHA


def test_chi2_sf_reference_values() -> None:
    # textbook critical values: P(chi2_df > x) = 1e-3
    for df, x in ((1, 10.828), (3, 16.266), (10, 29.588), (15, 37.697)):
        assert math.isclose(chi2_sf(x, df), 1e-3, rel_tol=2e-3)
    assert math.isclose(chi2_sf(2.0, 2), math.exp(-1.0), rel_tol=1e-12)


def test_same_seed_same_tokens(setup) -> None:
    model, tokenizer, head, _, _ = setup
    sampler = make_sampler(temp=0.9, top_p=0.95)

    def run(seed: int) -> list[int]:
        mx.random.seed(seed)
        out = mtp_stream_generate(model, tokenizer, "Seeded", head, 16, num_draft_tokens=2, sampler=sampler)
        return [r.token for r in out]

    first = run(3)
    assert run(3) == first
    assert run(4) != first
