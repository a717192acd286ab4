"""Verify-time layer variants against mlx-lm itself: recurrent state captured inside the
verify (melix_mlx.runtime.capture) and latent attention in its absorbed form (melix_mlx.runtime.absorbed_mla).

- The capturing layer's outputs and final caches equal mlx-lm's own layer bit for bit
  (max |diff| = 0) for blocks of 1..4 tokens, single and batched.
- The state it selects after n of the block's positions equals the state of a cache fed
  only those n tokens, bit for bit, per row (rows select different lengths).
- Installing changes no parameter and is idempotent; an unarmed cache never records.
- The recurrence's two forms (gates once per block / mlx-lm's update per position, the
  Metal form) agree bit for bit on this CPU.
- A verify's latent attention gives, row by row, exactly mlx-lm's one-token logits
  (measured max |diff| = 0 on the CPU wheel), and stays within 1e-4 of mlx-lm's own
  multi-token form (which expands the whole context).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime import capture
from melix_mlx.runtime.hidden import forward_with_hidden
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

PROMPT = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]]


def _recurrent(cache):
    return [c for c in cache if isinstance(c, ArraysCache)]


def _max_diff(a, b) -> float:
    worst = 0.0
    for x, y in zip(_recurrent(a), _recurrent(b)):
        for u, v in zip(x.cache, y.cache, strict=True):
            worst = max(worst, mx.abs(u - v).max().item())
    return worst


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    model = load_with_heads(tiny_checkpoint("qwen3_5"))[0]
    reference = load_with_heads(tiny_checkpoint("qwen3_5"))[0]  # never installed: mlx-lm's own layers
    capture.install(model)
    return model, reference


def _primed(model, rows: int):
    cache = make_prompt_cache(model)
    forward_with_hidden(model, mx.array(PROMPT[:rows]), cache)
    return cache


@pytest.mark.parametrize("length", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 2])
def test_armed_forward_equals_mlx_lm(qwen, length: int, rows: int) -> None:
    model, reference = qwen
    block = mx.array([[3, 4, 5, 6][:length]] * rows)
    ref_cache, cap_cache = _primed(reference, rows), _primed(model, rows)
    want_logits, want_hidden = forward_with_hidden(reference, block, ref_cache)
    armed = capture.arm(cap_cache)
    got_logits, got_hidden = forward_with_hidden(model, block, cap_cache)
    steps = capture.collect(armed)
    assert mx.abs(want_logits - got_logits).max().item() == 0.0
    assert mx.abs(want_hidden - got_hidden).max().item() == 0.0
    assert _max_diff(ref_cache, cap_cache) == 0.0
    assert all(len(s) == length for s in steps)


def test_selected_state_equals_a_cache_fed_only_the_kept_tokens(qwen) -> None:
    model, reference = qwen
    block = [[3, 4, 5, 6], [7, 8, 9, 10]]
    cache = _primed(model, 2)
    armed = capture.arm(cache)
    forward_with_hidden(model, mx.array(block), cache)
    steps = capture.collect(armed)
    keep = [3, 1]  # rows keep different prefixes
    capture.select(armed, steps, mx.array(keep))
    for row, n in enumerate(keep):
        clean = make_prompt_cache(reference)
        forward_with_hidden(reference, mx.array(PROMPT[row : row + 1]), clean)
        forward_with_hidden(reference, mx.array([block[row][:n]]), clean)
        for got, want in zip(_recurrent(cache), _recurrent(clean)):
            for u, v in zip(got.cache, want.cache, strict=True):
                assert mx.abs(u[row : row + 1] - v).max().item() == 0.0


def test_a_wrong_selection_is_visible(qwen) -> None:
    """The comparison is sharp: selecting one position too many differs."""
    model, reference = qwen
    cache = _primed(model, 1)
    armed = capture.arm(cache)
    forward_with_hidden(model, mx.array([[3, 4, 5]]), cache)
    steps = capture.collect(armed)
    capture.select(armed, steps, mx.array([2]))
    clean = make_prompt_cache(reference)
    forward_with_hidden(reference, mx.array(PROMPT[:1]), clean)
    forward_with_hidden(reference, mx.array([[3]]), clean)
    assert _max_diff(cache, clean) > 0.0


@pytest.mark.parametrize("masked", [False, True])
def test_both_recurrence_forms_agree(qwen, masked: bool) -> None:
    """The armed recurrence has two forms: mlx-lm's ops loop with the gates built once per
    block (no Metal device) and mlx-lm's `gated_delta_update` called per position (its
    kernel on Metal). On this CPU both run mlx-lm's ops: outputs and every recorded state
    must be equal bit for bit, with and without a padding mask (Hv > Hk: the repeat too)."""
    model, _ = qwen
    layer = next(m for m in capture._recurrent_layers(model))
    rows, length = 2, 3
    assert layer.num_v_heads > layer.num_k_heads
    keys = iter(mx.random.split(mx.random.key(7), 6))
    heads_k, dim_k, heads_v, dim_v = layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim
    q = mx.random.normal((rows, length, heads_k, dim_k), key=next(keys))
    k = mx.random.normal((rows, length, heads_k, dim_k), key=next(keys))
    v = mx.random.normal((rows, length, heads_v, dim_v), key=next(keys))
    a = mx.random.normal((rows, length, heads_v), key=next(keys))
    b = mx.random.normal((rows, length, heads_v), key=next(keys))
    state = mx.random.normal((rows, heads_v, dim_v, dim_k), key=next(keys))
    mask = mx.array([[True] * length, [False] + [True] * (length - 1)]) if masked else None
    ops_out, ops_states = capture._ops_recurrence(layer, q, k, v, a, b, state, mask)
    per_out, per_states = capture._update_per_position(layer, q, k, v, a, b, state, mask)
    assert len(ops_states) == len(per_states) == length
    for x, y in zip(ops_out + ops_states, per_out + per_states, strict=True):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


def test_install_keeps_parameters_and_is_idempotent(tiny_checkpoint) -> None:
    model = load_with_heads(tiny_checkpoint("qwen3_5"))[0]
    before = {k: v for k, v in tree_flatten(model.parameters())}
    assert capture.install(model) == capture.install(model) > 0
    after = {k: v for k, v in tree_flatten(model.parameters())}
    assert before.keys() == after.keys()
    assert all(before[k] is after[k] for k in before)
    cache = _primed(model, 1)  # unarmed: nothing recorded, nothing attached
    assert not any(hasattr(c, "melix_steps") for c in cache)
    assert capture.supported(model, cache)


def test_absorbed_verify_matches_one_token_decoding(loaded_heads) -> None:
    """The verify's latent attention (absorbed) gives mlx-lm's one-token logits row by row."""
    from melix_mlx.runtime import absorbed_mla, rollback

    model = loaded_heads["deepseek_v3"][0]
    assert absorbed_mla.install(model) > 0
    block = [3, 4, 5]
    stepwise = make_prompt_cache(model)
    forward_with_hidden(model, mx.array(PROMPT[:1]), stepwise)
    want = [forward_with_hidden(model, mx.array([[t]]), stepwise)[0][0, 0] for t in block]
    cache = make_prompt_cache(model)
    forward_with_hidden(model, mx.array(PROMPT[:1]), cache)
    marked = absorbed_mla.arm(rollback.leaves(cache))
    got = forward_with_hidden(model, mx.array([block]), cache)[0][0]
    absorbed_mla.disarm(marked)
    assert max(mx.abs(got[i] - want[i]).max().item() for i in range(len(block))) == 0.0
    expanded = make_prompt_cache(model)  # unmarked: mlx-lm's own multi-token form
    forward_with_hidden(model, mx.array(PROMPT[:1]), expanded)
    plain = forward_with_hidden(model, mx.array([block]), expanded)[0][0]
    assert max(mx.abs(got[i] - plain[i]).max().item() for i in range(len(block))) < 1e-4
