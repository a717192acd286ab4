"""Linear-attention state captured inside the verify: the Bailing and Kimi K3 layer kinds.

Rules of this module:
- Same contract as melix_mlx.runtime.capture (whose registry, `CAPTURING`, lists the
  classes here): a capturing layer is a subclass of mlx-lm's own class, installed on the
  loaded model's instances, adding no parameters; unarmed, it is mlx-lm's `__call__`
  unchanged; armed (its ArraysCache leaf carries the steps list), it records the cache's
  arrays after every verified position so rollback selects each row's state at its
  accepted length, with no replay forward.
- Armed, the layer runs mlx-lm's own `__call__` one position at a time over the verify
  block, recording `cache.cache` after each. Every value it produces is therefore what
  mlx-lm's one-token decoding computes at that position, on any device and for any of
  mlx-lm's internal forms (a Metal kernel, a compiled decode step, a chunked block form):
  a verify row equals the token-by-token run that greedy identity is measured against.
- Layer kinds (mlx-lm 0.32.2):
  * `bailing_moe_v3.BailingKDA` (Ling V3, Kimi delta attention): three causal convolutions
    and a gated-delta state with per-channel gates (ArraysCache of 4). On the CPU wheel
    mlx-lm's block form is its per-position ops loop, so the armed block also equals
    mlx-lm's own block call bit for bit.
  * `kimi_k3.KimiK3DeltaAttention`: one fused q/k/v convolution and the same per-channel
    gated-delta state (ArraysCache of 2); the same equality holds on the CPU.
  * `bailing_hybrid.LinearAttention` (Ling 2.5 lightning attention): a per-head constant
    decay `h_t = h_{t-1} exp(g) + k_t^T v_t` (ArraysCache of 1). mlx-lm runs blocks of
    more than one token in a chunked matmul form and single tokens in a one-step form; the
    armed block is the one-step form per position (token-by-token decoding, bit for bit)
    and agrees with mlx-lm's chunked block within float32 rounding (tests state the bound).
  * `bailing_moe_linear.LinearAttention` (Ring/Ling linear 2.0): the same decay, a plain
    per-step loop in mlx-lm for any block length; it ignores padding masks, as mlx-lm does.
- The two lightning layers take the RoPE offset of the block's first token (`offset`);
  position t of the block runs at `offset + t`, as it would when decoded alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import bailing_hybrid, bailing_moe_linear, bailing_moe_v3, kimi_k3

from .cache_leaves import ARMED  # the one attribute name every capturing layer records into


def _stepwise(layer_call: Any, x: mx.array, mask: Any, cache: Any, steps: list, **kw: Any) -> mx.array:
    """Run `layer_call` (mlx-lm's `__call__`) on each position of `x`, recording the cache's
    arrays after each; returns the outputs concatenated along the sequence axis."""
    offset = kw.pop("offset", None)
    outs = []
    for t in range(x.shape[1]):
        at = slice(t, t + 1)
        extra = {} if offset is None else {"offset": offset + t}
        outs.append(layer_call(x[:, at], None if mask is None else mask[:, at], cache, **extra))
        steps.append(tuple(cache.cache))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


def _armed_steps(cache: Any) -> list | None:
    return getattr(cache, ARMED, None) if cache is not None else None


class CapturingBailingKDA(bailing_moe_v3.BailingKDA):
    """mlx-lm's Bailing V3 KDA layer that records per-position state when armed."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        steps = _armed_steps(cache)
        if steps is None:
            return super().__call__(x, mask, cache)
        return _stepwise(super().__call__, x, mask, cache, steps)


class CapturingKimiK3DeltaAttention(kimi_k3.KimiK3DeltaAttention):
    """mlx-lm's Kimi K3 delta attention that records per-position state when armed."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        steps = _armed_steps(cache)
        if steps is None:
            return super().__call__(x, mask, cache)
        return _stepwise(super().__call__, x, mask, cache, steps)


class CapturingBailingHybridLinearAttention(bailing_hybrid.LinearAttention):
    """mlx-lm's Ling 2.5 lightning attention that records per-position state when armed."""

    def __call__(
        self, x: mx.array, mask: mx.array | None = None, cache: Any = None, offset: int = 0
    ) -> mx.array:
        steps = _armed_steps(cache)
        if steps is None:
            return super().__call__(x, mask, cache, offset=offset)
        return _stepwise(super().__call__, x, mask, cache, steps, offset=offset)


class CapturingBailingLinearAttention(bailing_moe_linear.LinearAttention):
    """mlx-lm's Ring/Ling linear 2.0 lightning attention, recording when armed."""

    def __call__(
        self, x: mx.array, mask: mx.array | None = None, cache: Any = None, offset: int = 0
    ) -> mx.array:
        steps = _armed_steps(cache)
        if steps is None:
            return super().__call__(x, mask, cache, offset=offset)
        return _stepwise(super().__call__, x, mask, cache, steps, offset=offset)


# mlx-lm layer class -> its capturing subclass (merged into capture.CAPTURING).
CAPTURING: dict[type, type] = {
    bailing_moe_v3.BailingKDA: CapturingBailingKDA,
    kimi_k3.KimiK3DeltaAttention: CapturingKimiK3DeltaAttention,
    bailing_hybrid.LinearAttention: CapturingBailingHybridLinearAttention,
    bailing_moe_linear.LinearAttention: CapturingBailingLinearAttention,
}
