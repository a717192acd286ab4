"""The controlled-acceptance draft source (melix_mlx.tools.controlled_draft).

- Its draws are right with probability p: over thousands of slots the share of proposals
  equal to the target's greedy token is p (within 5 binomial standard deviations), the
  others are never right; p = 1 and p = 0 are exact.
- In the decoder its acceptance is p at depth 1 (within 4 standard deviations of the
  proposals counted), 1 at p = 1 and 0 at p = 0, and the output is mlx-lm's greedy output
  token for token, single sequence and batched.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads
from melix_mlx.tools.controlled_draft import ControlledDraft
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import KVCache

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]]
N = 40


class _NoHead:
    """A stand-in head (no forward cost): zeros, one KVCache."""

    def make_cache(self) -> list:
        return [KVCache()]

    def __call__(self, hidden, tokens, cache=None, mask=None):
        B, L = tokens.shape
        return mx.zeros((B, L, VOCAB_SIZE)), mx.zeros((B, L, 4))


@pytest.mark.parametrize("p", [0.0, 0.8, 1.0])
def test_draws_are_right_with_probability_p(p):
    script = [(7 * i + 3) % VOCAB_SIZE for i in range(120)]
    source = ControlledDraft(_NoHead(), [script], VOCAB_SIZE, p, seed=5)
    right = wrong = 0
    for _ in range(40):
        cache = source.make_cache()
        tokens = mx.array([script[1:101]])  # slots 0..99: fed t_{j+1}, predicting t_{j+2}
        logits, _ = source(mx.zeros((1, 100, 4)), tokens, cache)
        want = mx.array([script[2:102]])
        drawn = mx.argmax(logits, axis=-1)
        right += int((drawn == want).sum().item())
        wrong += int((drawn == (want + 1) % VOCAB_SIZE).sum().item())
    n = 40 * 100
    assert right + wrong == n  # a proposal is the right token or the designated wrong one
    assert abs(right / n - p) <= 5 * math.sqrt(p * (1 - p) / n)


@pytest.fixture(scope="module")
def ernie(tiny_checkpoint):
    model, _, head, _ = load_with_heads(tiny_checkpoint("ernie4_5_moe"))
    scripts = [p + reference(model, p, N + 8) for p in PROMPTS]
    return model, head, scripts


@pytest.mark.parametrize("p", [0.0, 0.8, 1.0])
def test_decoder_accepts_at_p_and_keeps_identity(ernie, p):
    model, head, scripts = ernie
    source = ControlledDraft(head, scripts, VOCAB_SIZE, p, seed=1)
    accepted = proposed = 0
    for prompt, script in zip(PROMPTS, scripts, strict=True):
        for k in (1, 2):
            got, decoder = mtp(model, source, prompt, N, k)
            assert got == script[len(prompt) : len(prompt) + N]
            if k == 1:
                accepted += decoder.stats["accepted"]
                proposed += decoder.stats["proposed"]
    assert proposed >= 50
    if p in (0.0, 1.0):
        assert accepted == p * proposed
    else:
        assert abs(accepted / proposed - p) <= 4 * math.sqrt(p * (1 - p) / proposed)


def test_batched_identity(ernie):
    model, head, scripts = ernie
    gen = MTPBatchGenerator(model, ControlledDraft(head, scripts, VOCAB_SIZE, 0.8), max_tokens=N)
    uids = gen.insert(PROMPTS, num_draft_tokens=[1, 2, 3])
    out: dict[int, list[int]] = {u: [] for u in uids}
    while gen.batch.uids or gen._queue:
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    for uid, prompt, script in zip(uids, PROMPTS, scripts, strict=True):
        assert out[uid] == script[len(prompt) : len(prompt) + N]
    stats = gen.speculative_stats()
    assert 0.3 < stats["acceptance_rate"] < 1.0
