"""The head projects to the vocabulary only the slots the engine draws from.

`trunk` + `logits` is the head's call in two parts; a prompt's prime projects its last
slot only and feeds long prompts in chunks, as the prefill does. Each must give what the
whole call gives.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime.engine import CycleEngine
from melix_mlx.runtime.hidden import forward_with_hidden
from melix_mlx.tools.tiny import ALL_FAMILIES, FAMILIES
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


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("slot", [0, 1, 2])
def test_the_head_read_at_one_slot_is_the_whole_head_read_there(tiny_checkpoint, family, slot):
    """A cycle's catch-up (3 verified slots on a primed cache) read at one slot: the MLP
    runs there only, attention at every slot; the same hidden, logits and cache."""
    model, tok, head, _ = load_with_heads(tiny_checkpoint(family))
    tokens, hiddens = _prompt_hiddens(model, tok)
    split = len(tokens) - 4
    caches = [head.make_cache() for _ in range(3)]
    for cache in caches:  # the prompt's pairs, primed alike
        mx.eval(head.trunk(hiddens[None, :split], tokens[None, 1 : split + 1], cache))
    catch_h, catch_t = hiddens[None, split:-1], tokens[None, split + 1 :]
    at = mx.array([[[slot]]], dtype=mx.int32)
    whole = head.trunk(catch_h, catch_t, caches[0])[:, slot : slot + 1]
    read = head.trunk_at(catch_h, catch_t, caches[1], at)
    logits, hidden = head.at_slot(catch_h, catch_t, caches[2], at)
    assert read.shape == hidden.shape == whole.shape
    assert mx.allclose(read, whole, atol=1e-4, rtol=1e-4)
    assert mx.allclose(hidden, whole, atol=1e-4, rtol=1e-4)
    assert mx.allclose(logits, head.logits(whole)[:, 0], atol=1e-3, rtol=1e-3)
    for cache in caches[1:]:
        for a, b in zip(caches[0], cache, strict=True):
            for x, y in zip(_leaves(a.state), _leaves(b.state), strict=True):
                assert x.shape == y.shape
                assert mx.allclose(x, y, atol=1e-4, rtol=1e-4)


# heads whose block is not pre-norm attention then MLP: the trunk runs whole, then is read
WHOLE_TRUNK = {"nemotron_h", "deepseek_v41"}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_a_head_read_at_one_slot_runs_its_mlp_at_that_slot_only(tiny_checkpoint, family):
    model, tok, head, _ = load_with_heads(tiny_checkpoint(family))
    head = getattr(head, "heads", [head])[0]  # a stacked head reads through its first layer
    parts = getattr(head, "BLOCK_PARTS", None)
    assert (parts is None) == (family in WHOLE_TRUNK)
    if parts is None:
        return
    block, seen = head._block(), []
    mlp = getattr(block, parts[3])

    def recording(x: mx.array) -> mx.array:
        seen.append(x.shape[1])
        return mlp(x)

    object.__setattr__(block, parts[3], recording)  # shadows the module for this head only
    tokens, hiddens = _prompt_hiddens(model, tok)
    head.trunk_at(hiddens[None, :3], tokens[None, 1:4], head.make_cache(), mx.array([[[1]]], dtype=mx.int32))
    assert seen == [1]


def _leaves(state) -> list[mx.array]:
    """The arrays of a cache's state (nested tuples, lists; counters left out)."""
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (tuple, list)):
        return [leaf for part in state for leaf in _leaves(part)]
    return []
