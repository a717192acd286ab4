"""The head projects to the vocabulary only the slots the engine draws from.

`trunk` + `logits` is the head's call in two parts; a prompt's prime projects its last
slot only and feeds long prompts in chunks, as the prefill does. Each must give what the
whole call gives.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from melix_mlx.runtime.engine import CycleEngine
from melix_mlx.runtime.hidden import forward_with_hidden
from melix_mlx.tools.tiny import FAMILIES
from mlx_lm.models.cache import make_prompt_cache

PROMPT = "The quick brown fox jumps over the lazy dog, then naps in the sun."


def _prompt_hiddens(model, tok):
    x = mx.array([tok.encode(PROMPT)])
    _, hidden = forward_with_hidden(model, x, make_prompt_cache(model))
    return x[0], hidden[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_then_logits_is_the_whole_call(loaded_heads, family):
    model, tok, head, _ = loaded_heads[family]
    tokens, hiddens = _prompt_hiddens(model, tok)
    whole_logits, whole_hidden = head(hiddens[None, :-1], tokens[None, 1:], head.make_cache())
    out = head.trunk(hiddens[None, :-1], tokens[None, 1:], head.make_cache())
    assert mx.array_equal(out, whole_hidden)
    last = head.logits(out[:, -1:])  # one slot projected alone
    assert last.shape == (1, 1, whole_logits.shape[-1])
    assert mx.allclose(last[0, 0], whole_logits[0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("step_size", [1, 5, 4096])
def test_prime_in_chunks_matches_one_whole_call(loaded_heads, family, step_size):
    model, tok, head, _ = loaded_heads[family]
    tokens, hiddens = _prompt_hiddens(model, tok)
    pairs = [*tokens[1:].tolist(), 7]  # (h_i, t_{i+1}) for every prompt slot, then a first token
    reference_cache = head.make_cache()
    logits, out = head(hiddens[None], mx.array([pairs]), reference_cache)

    engine = CycleEngine(model, head, make_prompt_cache(model), head.make_cache())
    cache = head.make_cache()
    row = engine.prime(cache, hiddens, pairs, None, step_size=step_size)

    assert row.draft.item() == mx.argmax(logits[0, -1]).item()
    assert mx.allclose(row.hidden[0, 0], out[0, -1], atol=1e-4, rtol=1e-4)
    assert cache[0].offset == reference_cache[0].offset == len(pairs)
    keys, ref_keys = cache[0].state[0], reference_cache[0].state[0]
    assert mx.allclose(keys[..., : len(pairs), :], ref_keys[..., : len(pairs), :], atol=1e-4, rtol=1e-4)
