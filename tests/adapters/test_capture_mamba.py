"""Mamba-2 state captured inside the verify (melix_mlx.runtime.capture_mamba) against mlx-lm.

On a tiny Nemotron-H checkpoint (Mamba-2, attention, MLP and MoE layers), CPU wheel:
- an armed verify block of 1..4 tokens gives, row by row, exactly mlx-lm's token-by-token
  decoding (logits, hidden states and final caches, max |diff| = 0), single and batched;
- mlx-lm's own block form (the chunked SSD `ssm_attn` over the block) is NOT the
  token-by-token computation: measured here, it differs by more than 0 and stays within
  1e-5 in logits. That is why the armed mixer runs the state update per position;
- the state selected after n of the block's positions equals the state of a cache fed
  only those n tokens one at a time, bit for bit, per row (rows select different n);
  selecting one position too many is visible;
- at the mixer, with a padding mask (a left-padded row), the armed block equals mlx-lm's
  mixer called one position at a time with each position's mask; its CPU one-token form
  (`one_position`) equals mlx-lm's `ssm_update` over one token at the tiny and at
  Nemotron-3's sizes, masked or not, float32 and bfloat16;
- installing changes no parameter and is idempotent; the model's recurrent caches are
  then `supported`, and are not without the capturing mixer; an unarmed cache records
  nothing; an armed cache prepared with right-padding lengths is refused.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime import capture
from melix_mlx.runtime.cache_leaves import ARMED
from melix_mlx.runtime.capture_mamba import CapturingMamba2Mixer, one_position
from melix_mlx.runtime.hidden import forward_with_hidden
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.models.nemotron_h import NemotronHMamba2Mixer
from mlx_lm.models.ssm import ssm_update

PROMPT = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]]


def _recurrent(cache):
    return [c for c in cache if isinstance(c, ArraysCache)]


def _max_diff(a, b) -> float:
    worst = 0.0
    for x, y in zip(_recurrent(a), _recurrent(b), strict=True):
        for u, v in zip(x.cache, y.cache, strict=True):
            worst = max(worst, mx.abs(u - v).max().item())
    return worst


@pytest.fixture(scope="module")
def nemotron(tiny_checkpoint):
    model = load_with_heads(tiny_checkpoint("nemotron_h"))[0]
    reference = load_with_heads(tiny_checkpoint("nemotron_h"))[0]  # never installed: mlx-lm's own mixers
    assert capture.install(model) == 3  # the tiny pattern "M-M*EM"
    return model, reference


def _primed(model, rows: int):
    cache = make_prompt_cache(model)
    forward_with_hidden(model, mx.array(PROMPT[:rows]), cache)
    return cache


def _tokenwise(model, cache, block: list[list[int]]) -> tuple[mx.array, mx.array]:
    """mlx-lm's one-token decoding over `block` [rows, n]: (logits, hidden) [rows, n, ...]."""
    outs = [
        forward_with_hidden(model, mx.array([[r[t]] for r in block]), cache) for t in range(len(block[0]))
    ]
    return mx.concatenate([o[0] for o in outs], axis=1), mx.concatenate([o[1] for o in outs], axis=1)


@pytest.mark.parametrize("length", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 2])
def test_armed_block_equals_token_by_token_decoding(nemotron, length: int, rows: int) -> None:
    model, reference = nemotron
    block = [[3, 4, 5, 6][:length], [9, 8, 7, 6][:length]][:rows]
    ref_cache, cap_cache = _primed(reference, rows), _primed(model, rows)
    want_logits, want_hidden = _tokenwise(reference, ref_cache, block)
    armed = capture.arm(cap_cache)
    got_logits, got_hidden = forward_with_hidden(model, mx.array(block), cap_cache)
    steps = capture.collect(armed)
    assert mx.abs(want_logits - got_logits).max().item() == 0.0
    assert mx.abs(want_hidden - got_hidden).max().item() == 0.0
    assert _max_diff(ref_cache, cap_cache) == 0.0
    assert len(steps) == 3 and all(len(s) == length for s in steps)


def test_mlx_lm_block_form_is_not_token_by_token(nemotron) -> None:
    """The reason the armed mixer steps per position: mlx-lm's chunked block differs."""
    model, reference = nemotron
    block = [[3, 4, 5, 6]]
    stepwise, chunked = _primed(reference, 1), _primed(reference, 1)
    want, _ = _tokenwise(reference, stepwise, block)
    got, _ = forward_with_hidden(reference, mx.array(block), chunked)
    assert 0.0 < mx.abs(want - got).max().item() < 1e-5


def test_selected_state_equals_a_cache_fed_only_the_kept_tokens(nemotron) -> None:
    model, reference = nemotron
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
        for t in block[row][:n]:
            forward_with_hidden(reference, mx.array([[t]]), clean)
        for got, want in zip(_recurrent(cache), _recurrent(clean), strict=True):
            for u, v in zip(got.cache, want.cache, strict=True):
                assert mx.abs(u[row : row + 1] - v).max().item() == 0.0


def test_a_wrong_selection_is_visible(nemotron) -> None:
    model, reference = nemotron
    cache = _primed(model, 1)
    armed = capture.arm(cache)
    forward_with_hidden(model, mx.array([[3, 4, 5]]), cache)
    steps = capture.collect(armed)
    capture.select(armed, steps, mx.array([2]))
    clean = make_prompt_cache(reference)
    forward_with_hidden(reference, mx.array(PROMPT[:1]), clean)
    forward_with_hidden(reference, mx.array([[3]]), clean)
    assert _max_diff(cache, clean) > 0.0


def test_masked_block_equals_the_mixer_per_position(nemotron) -> None:
    """A left-padded row (mask False at its first position) and a full row: the armed
    mixer over the block equals mlx-lm's mixer called per position with that position's
    mask, outputs and every recorded (window, state)."""
    model, _ = nemotron
    layer = next(m for m in capture._recurrent_layers(model))
    rows, length = 2, 3
    keys = iter(mx.random.split(mx.random.key(11), 3))
    x = mx.random.normal((rows, length, layer.hidden_size), key=next(keys))
    window = mx.random.normal((rows, layer.conv_kernel_size - 1, layer.conv_dim), key=next(keys))
    state = mx.random.normal((rows, layer.num_heads, layer.head_dim, layer.ssm_state_size), key=next(keys))
    mask = mx.array([[False, True, True], [True, True, True]])
    armed, plain = ArraysCache(2), ArraysCache(2)
    for c in (armed, plain):
        c[0], c[1] = window, state
    setattr(armed, ARMED, [])
    got = layer(x, mask, armed)
    want, want_steps = [], []
    for t in range(length):
        want.append(NemotronHMamba2Mixer.__call__(layer, x[:, t : t + 1], mask[:, t : t + 1], plain))
        want_steps.append(tuple(plain.cache))
    assert mx.array_equal(got, mx.concatenate(want, axis=1)).item()
    recorded = getattr(armed, ARMED)
    assert len(recorded) == length
    for (w, s), (ww, ws) in zip(recorded, want_steps, strict=True):
        assert mx.array_equal(w, ww).item() and mx.array_equal(s, ws).item()


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", [(8, 8, 2, 16), (64, 64, 8, 128)], ids=["tiny", "nemotron-3"])
def test_one_position_is_mlx_lm_one_token_update(shape, dtype, masked: bool) -> None:
    """The CPU one-token form in fewer ops equals mlx-lm's `ssm_update` over one token bit
    for bit (outputs, states, dtypes), at the tiny and at Nemotron-3's head sizes."""
    heads, head_dim, groups, size = shape
    rows = 3
    keys = iter(mx.random.split(mx.random.key(heads + size), 8))
    x = mx.random.normal((rows, 1, heads, head_dim), key=next(keys)).astype(dtype)
    B = mx.random.normal((rows, 1, groups, size), key=next(keys)).astype(dtype)
    C = mx.random.normal((rows, 1, groups, size), key=next(keys)).astype(dtype)
    dt = mx.random.normal((rows, 1, heads), key=next(keys)).astype(dtype)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (heads,), key=next(keys)))
    D = mx.random.normal((heads,), key=next(keys)).astype(dtype)
    dt_bias = mx.random.normal((heads,), key=next(keys))
    state = mx.random.normal((rows, heads, head_dim, size), key=next(keys))
    mask = mx.array([[True], [False], [True]]) if masked else None
    args = (x, A_log, B, C, D, dt, dt_bias, state, (0.0, float("inf")), mask)
    for want, got in zip(ssm_update(*args), one_position(*args), strict=True):
        assert want.dtype == got.dtype and mx.array_equal(want, got).item()


def test_install_keeps_parameters_and_is_idempotent(tiny_checkpoint) -> None:
    model = load_with_heads(tiny_checkpoint("nemotron_h"))[0]
    cache = _primed(model, 1)
    assert not capture.supported(model, cache)  # mlx-lm's own mixers: no exact rollback
    before = dict(tree_flatten(model.parameters()))
    assert capture.install(model) == capture.install(model) == 3
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert all(type(m) is CapturingMamba2Mixer for m in capture._recurrent_layers(model))
    assert capture.supported(model, cache)
    forward_with_hidden(model, mx.array([[3]]), cache)  # unarmed: nothing recorded
    assert not any(hasattr(c, ARMED) for c in cache)


def test_armed_cache_with_lengths_is_refused(nemotron) -> None:
    model, _ = nemotron
    cache = _primed(model, 1)
    for c in _recurrent(cache):
        c.prepare(lengths=[1])
    capture.arm(cache)
    with pytest.raises(ValueError, match="right-padding lengths"):
        forward_with_hidden(model, mx.array([[3, 4]]), cache)


def test_padded_joint_prefill_equals_each_row_alone(nemotron) -> None:
    """Prompts of different lengths prefilled together (right-padded, as mlx-lm's
    BatchGenerator does) give each row its single-sequence prefill bit for bit with the
    capturing mixer; mlx-lm's own mixer ignores the rows' lengths in the state update and
    a padded row comes out wrong (the bug the capturing mixer's `_ssm` fixes)."""
    from melix_mlx.runtime.prefill import prefill_together, prefill_with_hidden
    from mlx_lm.generate import _merge_caches

    prompts = [[5, 17, 33, 2, 9, 41, 7], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114], [9]]
    worst = {}
    for name, m in zip(("capturing", "mlx-lm"), nemotron, strict=True):
        cache = _merge_caches([make_prompt_cache(m) for _ in prompts])
        logits, hiddens = prefill_together(m, prompts, cache)
        worst[name] = 0.0
        for row, prompt in enumerate(prompts):
            alone = make_prompt_cache(m)
            want_logits, want_hidden = prefill_with_hidden(m, mx.array(prompt), alone)
            own = [c.extract(row) for c in cache]
            worst[name] = max(
                worst[name],
                mx.abs(want_logits[0] - logits[row]).max().item(),
                mx.abs(want_hidden - hiddens[row]).max().item(),
                _max_diff(own, alone),
            )
    assert worst["capturing"] == 0.0
    assert worst["mlx-lm"] > 1e-3
