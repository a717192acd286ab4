"""Linear-attention state captured inside the verify: the Bailing and Kimi K3 layer kinds.

Rules of this module:
- Same contract as melix_mlx.runtime.capture (whose registry, `CAPTURING`, lists the
  classes here): a capturing layer is a subclass of mlx-lm's own class, installed on the
  loaded model's instances, adding no parameters; unarmed, it is mlx-lm's `__call__`
  unchanged; armed (its ArraysCache leaf carries the steps list), it records the cache's
  arrays after every verified position so rollback selects each row's state at its
  accepted length, with no replay forward.
- Armed, the projections, convolutions, norms and gates run over the whole verify block
  (weights read once, as mlx-lm's block call reads them) and only the recurrence runs one
  position at a time, through mlx-lm's own one-position code, recording the state after
  each position. On the CPU wheel every output and state equals mlx-lm decoding the block
  one token at a time, bit for bit (tests/adapters/test_capture_linear.py).
- Layer kinds (mlx-lm 0.32.2):
  * `bailing_moe_v3.BailingKDA` (Ling V3, Kimi delta attention): three causal convolutions
    and a gated-delta state with per-channel lower-bounded gates (ArraysCache of 4). The
    recurrence is mlx-lm's ops step per position (its block form on the CPU, so the armed
    block also equals mlx-lm's block call bit for bit); with a Metal device, mlx-lm's
    `gated_delta_update` (its kernel) once per position, as melix_mlx.runtime.capture does.
  * `bailing_hybrid.LinearAttention` (Ling 2.5 lightning attention): a per-head constant
    decay `h_t = h_{t-1} exp(g) + k_t^T v_t` (ArraysCache of 1). mlx-lm runs blocks of more
    than one token in a chunked matmul form and single tokens in its compiled one-step
    form; the armed block is the one-step form per position (token-by-token decoding) and
    agrees with mlx-lm's chunked block within float32 rounding (tests state the bound).
  * `bailing_moe_linear.LinearAttention` (Ring/Ling linear 2.0): the same decay, a plain
    per-step loop in mlx-lm for any block length, recorded step by step; it ignores
    padding masks, as mlx-lm does.
  * `kimi_k3.KimiK3DeltaAttention`: with a Metal device mlx-lm decodes one token through
    its own compiled step, so the armed block runs mlx-lm's whole `__call__` once per
    position (exact on any device, the weights read once per position); so does Kimi
    Linear's `kimi_linear.KimiDeltaAttention` (a family without an MTP head, which a draft
    model may speculate on), and every kind above when a batch cache carries per-row
    `lengths` (a padded prefill's form).
- The two lightning layers take the RoPE offset of the block's first token (`offset`);
  position t of the block runs at `offset + t`, as it would when decoded alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import bailing_hybrid, bailing_moe_linear, bailing_moe_v3, kimi_k3, kimi_linear
from mlx_lm.models.bailing_hybrid import _recurrent_gla_step  # pinned mlx-lm minor: pyproject
from mlx_lm.models.gated_delta import (
    _gated_delta_step_ops,  # mlx-lm's one-position step (pinned mlx-lm minor: pyproject)
    compute_lower_bound_g,
    gated_delta_update,
    normalize_qk,
)

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


def _kda_recurrence(
    layer: Any, q: mx.array, k: mx.array, v: mx.array, raw_gate: mx.array, b: mx.array, state: Any, mask: Any
) -> tuple[list[mx.array], list[mx.array]]:
    """The lower-bounded gated-delta recurrence one position at a time: (outputs, states)."""
    heads, dim = layer.num_heads, layer.head_dim
    A_log, dt_bias = layer.A_log.reshape(heads, 1), layer.dt_bias.reshape(heads, dim)
    if state is None:
        state = mx.zeros((q.shape[0], heads, dim, dim), dtype=mx.float32)
    outs, states = [], []
    if mx.metal.is_available():  # mlx-lm may run its kernel: call its update once per position
        for t in range(q.shape[1]):
            at = slice(t, t + 1)
            y, state = gated_delta_update(
                q[:, at], k[:, at], v[:, at], raw_gate[:, at], b[:, at], A_log, dt_bias, state,
                None if mask is None else mask[:, at],
                use_kernel=not layer.training, lower_bound=layer.lower_bound,
            )  # fmt: skip
            outs.append(y)
            states.append(state)
        return outs, states
    # mlx-lm's ops form (no Metal device): the gates over the block, then its compiled step
    beta = mx.sigmoid(b)
    g = compute_lower_bound_g(A_log, raw_gate, dt_bias, layer.lower_bound)
    for t in range(q.shape[1]):
        y, state = _gated_delta_step_ops(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t]
        )
        outs.append(mx.expand_dims(y, 1))
        states.append(state)
    return outs, states


class CapturingBailingKDA(bailing_moe_v3.BailingKDA):
    """mlx-lm's Bailing V3 KDA layer that records per-position state when armed."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        steps = _armed_steps(cache)
        if steps is None:
            return super().__call__(x, mask, cache)
        if cache.lengths is not None:  # a padded prefill's per-row conv windows
            return _stepwise(super().__call__, x, mask, cache, steps)
        batch, length, _ = x.shape
        keep = self.conv_kernel_size - 1
        shape = (batch, length, self.num_heads, self.head_dim)
        convolved, windows = [], []
        for i, (proj, conv) in enumerate(
            ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        ):
            h = proj(x)
            if mask is not None:
                h = mx.where(mask[..., None], h, 0)
            previous = cache[i]
            if previous is None:
                previous = mx.zeros((batch, keep, h.shape[-1]), dtype=h.dtype)
            conv_input = mx.concatenate([previous, h], axis=1)
            cache[i] = mx.contiguous(conv_input[:, -keep:, :])
            convolved.append(nn.silu(conv(conv_input)).reshape(shape))
            windows.append(conv_input)
        q, k = normalize_qk(convolved[0], convolved[1], inv_scale=self.head_dim**-0.5, eps=1e-6)
        raw_gate = self.f_proj(x).reshape(shape)
        b = self.b_proj(x).astype(mx.float32)
        outs, states = _kda_recurrence(self, q, k, convolved[2], raw_gate, b, cache[3], mask)
        for t, state in enumerate(states):  # the conv windows after t + 1 of the block's positions
            steps.append((*(w[:, t + 1 : t + 1 + keep] for w in windows), state))
        cache[3] = states[-1]
        cache.advance(length)
        output = self.o_norm(mx.concatenate(outs, axis=1))
        output_gate = self.g_proj(x).reshape(shape)
        output = output * mx.sigmoid(output_gate.astype(mx.float32)).astype(output.dtype)
        return self.o_proj(output.reshape(batch, length, -1))


class CapturingKimiK3DeltaAttention(kimi_k3.KimiK3DeltaAttention):
    """mlx-lm's Kimi K3 delta attention that records per-position state when armed."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        steps = _armed_steps(cache)
        if steps is None:
            return super().__call__(x, mask, cache)
        return _stepwise(super().__call__, x, mask, cache, steps)


class CapturingKimiLinearDeltaAttention(kimi_linear.KimiDeltaAttention):
    """mlx-lm's Kimi Linear delta attention (a no-MTP family a draft model may speculate on),
    recording per-position state when armed: mlx-lm's whole layer once per position."""

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
        if cache.lengths is not None:
            return _stepwise(super().__call__, x, mask, cache, steps, offset=offset)
        queries, keys, values = _lightning_qkv(self, x, offset, self.head_dim)
        h = cache[0]
        if h is None:  # mlx-lm holds the state in float32
            dims = (x.shape[0], self.num_attention_heads, self.head_dim, self.head_dim)
            h = mx.zeros(dims, dtype=mx.float32)
        exp_g = mx.exp(self._slope)[:, None, None].astype(h.dtype)
        scaled = queries * self.scale
        outs = []
        for t in range(x.shape[1]):  # mlx-lm's one-token form (its compiled step), per position
            at = slice(t, t + 1)
            y, h_t = _recurrent_gla_step(scaled[:, :, at], keys[:, :, at], values[:, :, at], h, exp_g)
            if mask is not None:
                kept = mask[:, t][:, None, None, None]
                y, h_t = mx.where(kept, y, 0), mx.where(kept, h_t, h)
            outs.append(y)
            h = h_t
            steps.append((h,))
        cache[0] = h
        cache.advance(x.shape[1])
        return _lightning_out(self, mx.concatenate(outs, axis=2), x)


class CapturingBailingLinearAttention(bailing_moe_linear.LinearAttention):
    """mlx-lm's Ring/Ling linear 2.0 lightning attention, recording when armed."""

    def __call__(
        self, x: mx.array, mask: mx.array | None = None, cache: Any = None, offset: int = 0
    ) -> mx.array:
        steps = _armed_steps(cache)
        if steps is None:
            return super().__call__(x, mask, cache, offset=offset)
        queries, keys, values = _lightning_qkv(self, x, offset, self.head_dim)
        # mlx-lm's recurrent_gla: the decay in the inputs' dtype, a loop over positions
        exp_g = mx.exp(self._slope)[:, None, None].astype(queries.dtype)
        scaled = queries * self.scale
        h, outs = cache[0], []
        for t in range(x.shape[1]):
            at = slice(t, t + 1)
            update = keys[:, :, at].transpose(0, 1, 3, 2) @ values[:, :, at]
            h = update if h is None else h * exp_g + update
            outs.append(scaled[:, :, at] @ h)
            steps.append((h,))
        cache[0] = h
        return _lightning_out(self, mx.concatenate(outs, axis=2), x)


def _lightning_qkv(layer: Any, x: mx.array, offset: int, head_dim: int) -> tuple[mx.array, ...]:
    """The lightning layers' queries, keys, values [B, H, L, D]: fused projection, q/k norms,
    RoPE from `offset`, over the whole block (mlx-lm's own steps)."""
    B, L, _ = x.shape
    heads, kv_heads = layer.num_attention_heads, layer.num_key_value_heads
    qkv = layer.query_key_value(x).reshape(B, L, heads + 2 * kv_heads, head_dim)
    q, k, v = mx.split(qkv, [heads, heads + kv_heads], axis=2)
    queries, keys, values = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if layer.use_qk_norm:
        queries, keys = layer.query_layernorm(queries), layer.key_layernorm(keys)
    return layer.rope(queries, offset=offset), layer.rope(keys, offset=offset), values


def _lightning_out(layer: Any, out: mx.array, x: mx.array) -> mx.array:
    """[B, H, L, D] recurrence output -> the layer's output: grouped norm, gate, projection."""
    B, L, _ = x.shape
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return layer.dense(layer.g_norm(out) * mx.sigmoid(layer.g_proj(x)))


# mlx-lm layer class -> its capturing subclass (merged into capture.CAPTURING).
CAPTURING: dict[type, type] = {
    bailing_moe_v3.BailingKDA: CapturingBailingKDA,
    kimi_k3.KimiK3DeltaAttention: CapturingKimiK3DeltaAttention,
    kimi_linear.KimiDeltaAttention: CapturingKimiLinearDeltaAttention,
    bailing_hybrid.LinearAttention: CapturingBailingHybridLinearAttention,
    bailing_moe_linear.LinearAttention: CapturingBailingLinearAttention,
}
