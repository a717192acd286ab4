"""Recurrent state captured inside the verify forward, so rollback never replays.

Rules of this module:
- A recurrent (ArraysCache) layer cannot be trimmed. Instead of restoring the pre-verify
  state and re-running the kept tokens (one extra full forward per rejecting cycle), the
  verify forward records the layer's state after EVERY verified position; rollback then
  selects the state at each row's accepted length (`select`), lazily, on the device.
- Capture is opt-in per cache leaf: `arm(cache)` marks the recurrent leaves of a cache;
  a capturing layer records into an armed leaf and behaves exactly like mlx-lm's own
  layer otherwise. `collect(cache)` disarms and returns the recorded states.
- The capturing layers are subclasses of mlx-lm's own classes, installed on the loaded
  model's layer instances (`install`). They add no parameters (save, load, quantize and
  shard see the same tree) and, unarmed, call mlx-lm's `__call__` unchanged.
- Exactness: the armed path computes the projections, the convolution and the gates over
  the whole verify block exactly as mlx-lm does, and runs the gated-delta recurrence one
  position at a time through mlx-lm's own code: without a Metal device, mlx-lm's
  recurrence is its ops loop (`gated_delta_ops`: gates over the block, then its compiled
  one-position step per position), which the armed path runs the same way, recording the
  state between steps; on Metal it calls mlx-lm's `gated_delta_update` (its kernel) once
  per position, which keeps the state in float32 between positions. Its outputs equal
  mlx-lm's bit for bit (tests/adapters/test_capture.py).
- Recurrent layers without a capturing subclass have no exact rollback here: `supported`
  tells the decoders, which refuse such a cache (melix_mlx.runtime.rollback.unsupported_kinds).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import (
    _gated_delta_step_ops,  # mlx-lm's one-position step (pinned mlx-lm minor: pyproject)
    compute_g,
    gated_delta_update,
    normalize_qk,
)

from . import capture_linear, capture_mamba, capture_ngram
from .cache_leaves import ARMED as _ARMED  # attribute an armed leaf carries: per-step states
from .cache_leaves import leaves


def _recur(
    layer: Any,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    state: mx.array | None,
    mask: mx.array | None,
    conv_input: mx.array,
    steps: list,
) -> tuple[list[mx.array], mx.array]:
    """The gated-delta recurrence one position at a time, recording each step's state."""
    n_keep = layer.conv_kernel_size - 1
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    step = _ops_recurrence if not mx.metal.is_available() else _update_per_position
    outs, state_at = step(layer, q, k, v, a, b, state, mask)
    for t, state in enumerate(state_at):  # the convolution window after t + 1 of the S positions
        steps.append((conv_input[:, t + 1 : t + 1 + n_keep], state))
    return outs, state


def _ops_recurrence(
    layer: Any, q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, state: Any, mask: Any
) -> tuple[list[mx.array], list[mx.array]]:
    """mlx-lm's `gated_delta_update` -> `gated_delta_ops` without a Metal kernel: the gates
    over the whole block, then its compiled step per position. Building the gates once
    per block (not per position) is the same arithmetic with fewer ops to build
    (benchmarks/bench_capture_build.py)."""
    beta = mx.sigmoid(b)
    g = compute_g(layer.A_log, a, layer.dt_bias)
    rows, _, heads_k, dim_k = q.shape
    heads_v, dim_v = v.shape[-2:]
    if state is None:
        state = mx.zeros((rows, heads_v, dim_v, dim_k), dtype=mx.float32)
    if (repeat := heads_v // heads_k) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    outs, states = [], []
    for t in range(q.shape[1]):
        y, state = _gated_delta_step_ops(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t]
        )
        outs.append(mx.expand_dims(y, 1))
        states.append(state)
    return outs, states


def _update_per_position(
    layer: Any, q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, state: Any, mask: Any
) -> tuple[list[mx.array], list[mx.array]]:
    """With a Metal device mlx-lm may run its kernel: call it once per position."""
    outs, states = [], []
    for t in range(q.shape[1]):
        at = slice(t, t + 1)
        y, state = gated_delta_update(
            q[:, at],
            k[:, at],
            v[:, at],
            a[:, at],
            b[:, at],
            layer.A_log,
            layer.dt_bias,
            state,
            None if mask is None else mask[:, at],
            use_kernel=not layer.training,
        )
        outs.append(y)
        states.append(state)
    return outs, states


def _conv_qkv(layer: Any, conv_input: mx.array, B: int, S: int) -> list[mx.array]:
    conv_out = nn.silu(layer.conv1d(conv_input))
    return [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]


class CapturingGatedDeltaNet(qwen3_5.GatedDeltaNet):
    """mlx-lm's Qwen3.5 GatedDeltaNet that records per-position state when its cache is armed."""

    def __call__(self, inputs: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        steps = getattr(cache, _ARMED, None) if cache is not None else None
        if steps is None:
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        if self.sharding_group is not None:
            inputs = sum_gradients(self.sharding_group)(inputs)
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)
        out = self.out_proj(_captured_block(self, qkv, z, a, b, mask, cache, steps))
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out


def _captured_block(
    layer: Any, qkv: mx.array, z: mx.array, a: mx.array, b: mx.array, mask: Any, cache: Any, steps: Any
) -> mx.array:
    """The armed gated-delta block both capturing layers share: conv window, per-position
    recurrence (states recorded), cache update, gated norm. Returns [B, S, value dims]."""
    B, S, _ = qkv.shape
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=qkv.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    q, k, v = _conv_qkv(layer, conv_input, B, S)
    outs, state = _recur(layer, q, k, v, a, b, cache[1], mask, conv_input, steps)
    cache[0] = mx.contiguous(conv_input[:, -(layer.conv_kernel_size - 1) :, :])
    cache[1] = state
    cache.advance(S)
    return layer.norm(mx.concatenate(outs, axis=1), z).reshape(B, S, -1)


class CapturingQwen3NextGatedDeltaNet(qwen3_next.Qwen3NextGatedDeltaNet):
    """mlx-lm's Qwen3-Next GatedDeltaNet (fused projections) with the same armed capture."""

    def __call__(self, inputs: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        steps = getattr(cache, _ARMED, None) if cache is not None else None
        if steps is None:
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        )
        mixed_qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return self.out_proj(_captured_block(self, mixed_qkv, z, a, b, mask, cache, steps))


# mlx-lm layer class -> its capturing subclass. A cache whose recurrent layers are not
# listed here is refused (no exact rollback).
CAPTURING: dict[type, type] = {
    qwen3_5.GatedDeltaNet: CapturingGatedDeltaNet,
    qwen3_next.Qwen3NextGatedDeltaNet: CapturingQwen3NextGatedDeltaNet,
}
CAPTURING.update(capture_linear.CAPTURING)  # Bailing and Kimi K3 linear attention
CAPTURING.update(capture_mamba.CAPTURING)  # Nemotron-H Mamba-2
CAPTURING.update(capture_ngram.CAPTURING)  # LongCat-Flash n-gram token context


def _recurrent_layers(model: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(_: str, module: nn.Module) -> None:
        if type(module) in CAPTURING or type(module) in CAPTURING.values():
            found.append(module)

    model.apply_to_modules(visit)
    return found


def install(model: nn.Module) -> int:
    """Give every recurrent layer of `model` its capturing subclass; returns how many.

    Idempotent. The layers' parameters and unarmed behaviour are unchanged.
    """
    layers = _recurrent_layers(model)
    for layer in layers:
        capturing = CAPTURING.get(type(layer))
        if capturing is not None:
            layer.__class__ = capturing
    return len(layers)


def captured_count(model: nn.Module) -> int:
    """How many recurrent layers of `model` capture (a walk of the whole module tree:
    callers that check every cycle count once and pass it to `supported`)."""
    return sum(type(m) in CAPTURING.values() for m in _recurrent_layers(model))


def supported(model: nn.Module, cache: list[Any], *, captured: int | None = None) -> bool:
    """Whether every recurrent leaf of `cache` is fed by a capturing layer of `model`.

    Counts match when each recurrent cache leaf belongs to one installed layer (the
    layer order of mlx-lm's `make_cache`); any recurrent layer we cannot capture means
    the cache has no exact rollback and is refused. `captured`: `captured_count(model)`
    if the caller has it.
    """
    recurrent = sum(isinstance(c, ArraysCache) for c in leaves(cache))
    if not recurrent:
        return True
    return (captured_count(model) if captured is None else captured) == recurrent


def arm(cache: list[Any]) -> list[ArraysCache]:
    """Mark every recurrent leaf to record per-position states in the next forward."""
    armed = [c for c in leaves(cache) if isinstance(c, ArraysCache)]
    for c in armed:
        setattr(c, _ARMED, [])
    return armed


def collect(armed: list[ArraysCache]) -> list[list[tuple[mx.array, ...]]]:
    """Disarm; per leaf, its arrays (here: conv window, recurrent state) after each verified position."""
    out = []
    for c in armed:
        out.append(getattr(c, _ARMED, None) or [])
        if hasattr(c, _ARMED):
            delattr(c, _ARMED)
    return out


def select(armed: list[ArraysCache], steps: list[list[tuple[mx.array, mx.array]]], keep: mx.array) -> None:
    """Set each leaf to its state after keep[b] positions, per row b (keep >= 1, lazy ok).

    A chain of `mx.where` over the recorded positions, with one row mask per position
    built once for all leaves: stacking every position's state and gathering along it
    (the obvious form) copies S full states per leaf and took 2-6x as long on the hybrid
    layout at batch 1-8 (benchmarks/bench_capture_select.py).
    """
    index = keep.astype(mx.int32) - 1
    row_masks: dict[tuple[int, int], mx.array] = {}  # (position, ndim) -> [B, 1, ...] mask

    def row_mask(position: int, ndim: int) -> mx.array:
        key = (position, ndim)
        if key not in row_masks:
            row_masks[key] = (index == position).reshape((-1,) + (1,) * (ndim - 1))
        return row_masks[key]

    for c, recorded in zip(armed, steps):
        if not recorded:
            continue
        chosen = list(recorded[0])
        for position in range(1, len(recorded)):
            for part in range(len(chosen)):  # every array the leaf holds (2 here, 1-4 in capture_linear)
                value = recorded[position][part]
                chosen[part] = mx.where(row_mask(position, value.ndim), value, chosen[part])
        c.cache = chosen
