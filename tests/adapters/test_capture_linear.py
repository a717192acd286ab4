"""Linear-attention capture (melix_mlx.runtime.capture_linear) against mlx-lm's own layers.

Each layer kind is built from mlx-lm's class with random weights and run on the same
instance armed (capturing) and unarmed (mlx-lm's `__call__`, untouched), from a state
primed with a prompt, for blocks of 1..4 tokens and two rows:
- the armed block's outputs and final cache arrays equal mlx-lm decoding the block one
  token at a time, bit for bit (max |diff| = 0);
- the gated-delta kinds (Ling V3 KDA, Kimi K3, Kimi Linear) also equal mlx-lm's own block call bit for
  bit on this CPU; Ling 2.5's lightning layer, which mlx-lm runs in a chunked form for
  blocks, agrees with that form within 1e-5 (float32 rounding of two arithmetic orders);
- the Ling V3 recurrence's two forms (ops step per position / mlx-lm's update per
  position, the Metal form) agree bit for bit on this CPU;
- the state `capture.select` picks after n positions, per row (rows keep different
  lengths), equals the state of a cache fed only those n tokens, bit for bit, and
  selecting one position too many is visible;
- installing on a loaded tiny model changes no parameter, is idempotent, and `supported`
  counts every recurrent leaf.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from melix_mlx.runtime import capture, capture_linear
from melix_mlx.tools.tiny_linear import CONFIGS
from mlx.utils import tree_flatten
from mlx_lm.models import bailing_hybrid, bailing_moe_linear, bailing_moe_v3, kimi_k3, kimi_linear
from mlx_lm.models.cache import ArraysCache

D = 64
ROWS = 2


def _bailing_v3() -> tuple[Any, int]:
    layer = bailing_moe_v3.BailingKDA(bailing_moe_v3.ModelArgs.from_dict(CONFIGS["bailing_moe_v3"]))
    layer.A_log = mx.log(mx.random.uniform(1.0, 16.0, layer.A_log.shape, key=mx.random.key(1)))
    layer.dt_bias = mx.random.normal(layer.dt_bias.shape, key=mx.random.key(2)) * 0.5
    return layer, 4


def _kimi_k3() -> tuple[Any, int]:
    cfg = {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0}
    args = kimi_k3.TextArgs(hidden_size=D, linear_attn_config=cfg, rms_norm_eps=1e-6)
    layer = kimi_k3.KimiK3DeltaAttention(args, layer_idx=0)
    layer.dt_bias = mx.random.normal(layer.dt_bias.shape, key=mx.random.key(2)) * 0.5
    return layer, 2


def _kimi_linear() -> tuple[Any, int]:
    cfg = {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}
    args = SimpleNamespace(hidden_size=D, rms_norm_eps=1e-6, linear_attn_config=cfg)  # what the layer reads
    layer = kimi_linear.KimiDeltaAttention(args, layer_idx=0)
    layer.dt_bias = mx.random.normal(layer.dt_bias.shape, key=mx.random.key(2)) * 0.5
    return layer, 4


def _bailing_hybrid() -> tuple[Any, int]:
    args = bailing_hybrid.ModelArgs.from_dict(CONFIGS["bailing_hybrid"])
    return bailing_hybrid.LinearAttention(args, layer_idx=0), 1


def _bailing_linear() -> tuple[Any, int]:
    cfg = {**CONFIGS["bailing_hybrid"], "model_type": "bailing_moe_linear", "head_dim": None}
    args = bailing_moe_linear.ModelArgs.from_dict(cfg)
    return bailing_moe_linear.LinearAttention(args, layer_idx=1), 1


KINDS = {
    "bailing_moe_v3": _bailing_v3,
    "kimi_k3": _kimi_k3,
    "kimi_linear": _kimi_linear,
    "bailing_hybrid": _bailing_hybrid,
    "bailing_moe_linear": _bailing_linear,
}
TAKES_OFFSET = {"bailing_hybrid", "bailing_moe_linear"}
PROMPT_LEN = 6


class Kind:
    """One layer kind: the installed layer, its cache size and how it is called."""

    def __init__(self, name: str) -> None:
        mx.random.seed(0)
        self.name = name
        self.layer, self.size = KINDS[name]()
        mx.eval(self.layer.parameters())
        assert capture.install(self.layer) == 1
        assert type(self.layer) is capture_linear.CAPTURING[type(self.layer).__mro__[1]]

    def call(self, x: mx.array, cache: ArraysCache, offset: int) -> mx.array:
        if self.name in TAKES_OFFSET:
            return self.layer(x, None, cache, offset=offset)
        return self.layer(x, None, cache)

    def primed(self, prompt: mx.array) -> ArraysCache:
        cache = ArraysCache(self.size)
        self.call(prompt, cache, 0)
        mx.eval(cache.cache)
        return cache


def _inputs(length: int, seed: int) -> mx.array:
    return mx.random.normal((ROWS, length, D), key=mx.random.key(seed))


def _copy(cache: ArraysCache) -> ArraysCache:
    out = ArraysCache(len(cache.cache))
    out.cache = list(cache.cache)
    return out


def _diff(a: list[mx.array], b: list[mx.array]) -> float:
    assert len(a) == len(b)
    return max(mx.abs(u - v).max().item() for u, v in zip(a, b, strict=True))


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request) -> Kind:
    return Kind(request.param)


@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_armed_block_equals_token_by_token_decoding(kind: Kind, length: int) -> None:
    prompt, block = _inputs(PROMPT_LEN, 10), _inputs(length, 11)
    base = kind.primed(prompt)
    stepwise = _copy(base)
    want = mx.concatenate(
        [kind.call(block[:, t : t + 1], stepwise, PROMPT_LEN + t) for t in range(length)], axis=1
    )
    armed_cache = _copy(base)
    armed = capture.arm([armed_cache])
    got = kind.call(block, armed_cache, PROMPT_LEN)
    [steps] = capture.collect(armed)
    assert not hasattr(armed_cache, "melix_steps")  # disarmed
    assert len(steps) == length and all(len(s) == kind.size for s in steps)
    assert mx.abs(got - want).max().item() == 0.0
    assert _diff(armed_cache.cache, stepwise.cache) == 0.0
    assert _diff(list(steps[-1]), stepwise.cache) == 0.0

    block_cache = _copy(base)  # mlx-lm's own block call
    plain = kind.call(block, block_cache, PROMPT_LEN)
    if kind.name == "bailing_hybrid" and length > 1:  # mlx-lm's chunked block form
        assert mx.abs(got - plain).max().item() < 1e-5
        assert _diff(armed_cache.cache, block_cache.cache) < 1e-5
    else:
        assert mx.abs(got - plain).max().item() == 0.0
        assert _diff(armed_cache.cache, block_cache.cache) == 0.0


def test_a_cache_with_row_lengths_takes_the_per_position_form(kind: Kind) -> None:
    """A batch cache still carrying per-row `lengths` (a padded prefill's chunks) is captured
    by running mlx-lm's whole layer per position: equal to token-by-token decoding."""
    prompt, block = _inputs(PROMPT_LEN, 40), _inputs(3, 41)
    base = kind.primed(prompt)
    stepwise, armed_cache = _copy(base), _copy(base)
    for c in (stepwise, armed_cache):
        c.lengths = mx.array([3] * ROWS)
    want = [kind.call(block[:, t : t + 1], stepwise, PROMPT_LEN + t) for t in range(3)]
    want = mx.concatenate(want, axis=1)
    armed = capture.arm([armed_cache])
    got = kind.call(block, armed_cache, PROMPT_LEN)
    [steps] = capture.collect(armed)
    assert len(steps) == 3 and mx.abs(got - want).max().item() == 0.0
    assert _diff(armed_cache.cache, stepwise.cache) == 0.0 and _diff(list(steps[-1]), stepwise.cache) == 0.0


def test_selected_state_equals_a_cache_fed_only_the_kept_tokens(kind: Kind) -> None:
    prompt, block = _inputs(PROMPT_LEN, 20), _inputs(4, 21)
    base = kind.primed(prompt)
    cache = _copy(base)
    armed = capture.arm([cache])
    kind.call(block, cache, PROMPT_LEN)
    steps = capture.collect(armed)
    keep = [3, 1]  # rows keep different prefixes
    capture.select(armed, steps, mx.array(keep))
    for row, n in enumerate(keep):
        clean = _copy(base)
        for t in range(n):
            kind.call(block[:, t : t + 1], clean, PROMPT_LEN + t)
        got = [c[row : row + 1] for c in cache.cache]
        assert _diff(got, [c[row : row + 1] for c in clean.cache]) == 0.0, (kind.name, row)
        kind.call(block[:, n : n + 1], clean, PROMPT_LEN + n)  # one position too many
        assert _diff(got, [c[row : row + 1] for c in clean.cache]) > 0.0, (kind.name, row)


@pytest.mark.parametrize("masked", [False, True])
def test_both_kda_recurrence_forms_agree(monkeypatch, masked: bool) -> None:
    """The Ling V3 recurrence has two forms: mlx-lm's ops step with the gates built once per
    block (no Metal device) and mlx-lm's `gated_delta_update` once per position (its kernel
    on Metal). On this CPU both run mlx-lm's ops: outputs and states equal bit for bit."""
    layer = Kind("bailing_moe_v3").layer
    rows, length, heads, dim = 2, 3, layer.num_heads, layer.head_dim
    keys = iter(mx.random.split(mx.random.key(7), 6))
    q, k, v, gate = (mx.random.normal((rows, length, heads, dim), key=next(keys)) for _ in range(4))
    b = mx.random.normal((rows, length, heads), key=next(keys))
    state = mx.random.normal((rows, heads, dim, dim), key=next(keys))
    mask = mx.array([[True] * length, [False] + [True] * (length - 1)]) if masked else None
    ops = capture_linear._kda_recurrence(layer, q, k, v, gate, b, state, mask)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    per = capture_linear._kda_recurrence(layer, q, k, v, gate, b, state, mask)
    for x, y in zip(ops[0] + ops[1], per[0] + per[1], strict=True):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


def test_unarmed_layer_is_mlx_lms_and_records_nothing(kind: Kind) -> None:
    cache = ArraysCache(kind.size)
    kind.call(_inputs(3, 30), cache, 0)
    assert not hasattr(cache, "melix_steps")
    plain = type(kind.layer).__mro__[1]  # mlx-lm's class
    assert type(kind.layer).__call__ is not plain.__call__
    assert capture.install(kind.layer) == 1  # idempotent


def test_the_marks_are_the_ones_the_engine_sets() -> None:
    from melix_mlx.runtime import absorbed_mla, cache_leaves

    assert capture._ARMED == cache_leaves.ARMED
    assert absorbed_mla._VERIFYING == cache_leaves.VERIFYING


@pytest.mark.parametrize("family", ["bailing_moe_v3", "bailing_hybrid"])
def test_install_on_a_tiny_checkpoint(tiny_checkpoint, family: str) -> None:
    from melix_mlx.loading import load_with_heads
    from mlx_lm.models.cache import make_prompt_cache

    model = load_with_heads(tiny_checkpoint(family))[0]
    before = dict(tree_flatten(model.parameters()))
    assert capture.install(model) == capture.install(model) == 2  # two linear layers of four
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    cache = make_prompt_cache(model)
    assert capture.supported(model, cache)
    assert capture.captured_count(model) == sum(isinstance(c, ArraysCache) for c in cache)
