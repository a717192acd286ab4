"""Mamba-2 state captured inside the verify: Nemotron-H's mixer.

Rules of this module:
- Same contract as melix_mlx.runtime.capture (whose registry, `CAPTURING`, lists the
  class here): the capturing mixer is a subclass of mlx-lm's `NemotronHMamba2Mixer`,
  installed on the loaded model's instances, adding no parameters; unarmed it is
  mlx-lm's `__call__` (one exception: the last rule); armed (its ArraysCache leaf carries
  the steps list) it records the leaf's two arrays, (convolution window, SSM state),
  after every verified position, so rollback selects each row's state at its accepted
  length with no replay.
- What mlx-lm computes: its mixer runs the state-space update through `ssm_update`, which
  for a block of more than one token (and, without a Metal device, for every block) is
  the chunked SSD form `ssm_attn`, and for one token with a state on a Metal device is
  its kernel. The chunked form over S tokens is not the one-token form applied S times
  (exp(a + b) against exp(a) exp(b), a matmul over the block): measured on the CPU
  wheel, mlx-lm's own 4-token block differs from its token-by-token decoding by up to
  4e-7 in logits. Greedy identity is measured against token-by-token decoding, so the
  armed mixer is the one-token form per position.
- Armed: the input projection, the causal convolution (mlx-lm's own `_conv`, which also
  updates the convolution window) and the gated norm and output projection run over the
  whole verify block, as mlx-lm runs them; the state update runs one position at a
  time in mlx-lm's one-token form with the position's mask: `ssm_update`, which
  dispatches exactly as mlx-lm's one-token decoding does (Metal: its kernel), or on the
  CPU, where that is `ssm_attn` over one token, `one_position`, the same arithmetic in
  half the ops (its doc says why it is exact). On the CPU wheel every output row and
  every recorded state equals mlx-lm's token-by-token decoding bit for bit
  (tests/adapters/test_capture_mamba.py); the convolution window after position t is
  the padded block input's rows t+1..t+K-1, what a one-token decode would have kept.
- A cache prepared with right-padding lengths (a prefill form) is never armed: the
  verify runs on a finalized cache; meeting one is a `ValueError`, not a guess.
- Unarmed, the mixer is mlx-lm's but for one thing: in a joint prefill of right-padded
  prompts (mlx-lm's `prepare(lengths=...)`, melix_mlx.runtime.prefill.prefill_together)
  it hands the rows' lengths to `ssm_update`, as mlx-lm's own Mamba-2 model
  (`mamba2.py`) does and its nemotron_h mixer does not: without them `ssm_attn` takes a
  shorter row's state at the padded end, where the mask has zeroed its decay, and the
  row's first token moved by 0.16 in logits on the tiny checkpoint (mlx-lm's own
  BatchGenerator then differs from its single-sequence output). With them each row's
  state, caches and logits equal its single-sequence prefill bit for bit.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import nemotron_h
from mlx_lm.models.ssm import compute_dt, ssm_update

from .cache_leaves import ARMED  # the one attribute name every capturing layer records into


def _armed_steps(cache: Any) -> list | None:
    return getattr(cache, ARMED, None) if cache is not None else None


class CapturingMamba2Mixer(nemotron_h.NemotronHMamba2Mixer):
    """mlx-lm's Nemotron-H Mamba-2 mixer that records per-position state when armed."""

    def __call__(self, hidden_states: mx.array, mask: mx.array | None, cache: Any = None) -> mx.array:
        steps = _armed_steps(cache)
        if steps is None:
            return super().__call__(hidden_states, mask, cache)
        if cache.lengths is not None:
            raise ValueError("a Mamba-2 cache prepared with right-padding lengths cannot be armed")
        projected = self.in_proj(hidden_states)
        gate, conv_input, dt = mx.split(
            projected, [self.intermediate_size, self.intermediate_size + self.conv_dim], axis=-1
        )
        windows = _windows(self, conv_input, cache, mask)  # before `_conv` replaces cache[0]
        conv_output = self._conv(conv_input, cache, mask)
        x, B, C = mx.split(
            conv_output,
            [self.intermediate_size, self.intermediate_size + self.n_groups * self.ssm_state_size],
            axis=-1,
        )
        y = _per_position(self, x, B, C, dt, cache, mask, windows, steps)
        cache.advance(y.shape[1])
        return self.out_proj(self.norm(y, gate))

    def _ssm(
        self, hidden_states: mx.array, B: mx.array, C: mx.array, dt: mx.array, cache: Any, mask: Any
    ) -> mx.array:
        """mlx-lm's `_ssm`; in a right-padded joint prefill it also hands the rows' lengths
        to `ssm_update`, as mlx-lm's own Mamba-2 model does (see the module rules)."""
        lengths = None if cache is None else cache.lengths
        if lengths is None:
            return super()._ssm(hidden_states, B, C, dt, cache, mask)
        rows, length, _ = hidden_states.shape
        y, cache[1] = ssm_update(
            hidden_states.reshape(rows, length, self.num_heads, self.head_dim),
            self.A_log,
            B.reshape(rows, length, self.n_groups, self.ssm_state_size),
            C.reshape(rows, length, self.n_groups, self.ssm_state_size),
            self.D.astype(hidden_states.dtype),
            dt,
            self.dt_bias,
            cache[1],
            self.time_step_limit,
            mask,
            lengths=lengths,
        )
        return y.reshape(rows, length, self.intermediate_size)


def _windows(layer: Any, conv_input: mx.array, cache: Any, mask: mx.array | None) -> list[mx.array]:
    """The convolution window a one-token decode keeps after each of the block's positions
    (the masked block input behind the current window, as mlx-lm's `_conv` pads it)."""
    if mask is not None:
        conv_input = mx.where(mask[..., None], conv_input, 0)
    state = cache[0]
    if state is None:
        state = mx.zeros(
            (conv_input.shape[0], layer.conv_kernel_size - 1, layer.conv_dim), dtype=conv_input.dtype
        )
    padded = mx.concatenate([state, conv_input], axis=1)
    n_keep = layer.conv_kernel_size - 1
    return [padded[:, t + 1 : t + 1 + n_keep, :] for t in range(conv_input.shape[1])]


def _per_position(
    layer: Any,
    x: mx.array,
    B: mx.array,
    C: mx.array,
    dt: mx.array,
    cache: Any,
    mask: mx.array | None,
    windows: list[mx.array],
    steps: list,
) -> mx.array:
    """mlx-lm's `_ssm` one position at a time (its one-token form per position: `ssm_update`,
    on the CPU `one_position`), recording (window, state) after each; sets the cache's
    state; returns y [B, S, intermediate]."""
    rows, length, _ = x.shape
    x = x.reshape(rows, length, layer.num_heads, layer.head_dim)
    B = B.reshape(rows, length, layer.n_groups, layer.ssm_state_size)
    C = C.reshape(rows, length, layer.n_groups, layer.ssm_state_size)
    D = layer.D.astype(x.dtype)
    state = cache[1]
    outs = []
    for t in range(length):
        at = slice(t, t + 1)
        step = one_position if state is not None and mx.default_device() == mx.cpu else ssm_update
        y, state = step(
            x[:, at],
            layer.A_log,
            B[:, at],
            C[:, at],
            D,
            dt[:, at],
            layer.dt_bias,
            state,
            layer.time_step_limit,
            None if mask is None else mask[:, at],
        )
        outs.append(y)
        steps.append((windows[t], state))
    cache[1] = state
    y = outs[0] if length == 1 else mx.concatenate(outs, axis=1)
    return y.reshape(rows, length, layer.intermediate_size)


def one_position(
    x: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    time_step_limit: tuple[float, float],
    mask: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's `ssm_attn` over ONE position with a state, the CPU one-token form, in about
    half the ops (graph building is what a verify's per-position loop costs): the same
    arithmetic where ssm_attn's steps are exact over one position. Its one-entry decay is
    exp(0) = 1 (exp(-inf) = 0 where masked), its one-term cumulative sum is the term, and
    its matmuls with an inner size of one are single products (broadcast products here);
    the two true reductions over the state size (C.B and state.C) stay matmuls of ssm_attn's
    shapes. Equal to `ssm_update` bit for bit, masked or not, in float32 and bfloat16
    (tests/adapters/test_capture_mamba.py); used on the CPU only, where `ssm_update` runs
    `ssm_attn` for one token (a GPU's matmul kernels are not assumed to match)."""
    rows, _, heads, head_dim = x.shape
    groups, size = B.shape[-2:]
    repeat = heads // groups
    dt = compute_dt(dt, dt_bias, time_step_limit)  # [rows, 1, heads], float32
    dtA = dt * (-mx.exp(A_log).astype(dt.dtype)).reshape(1, 1, -1)
    dtx = dt.reshape(rows, 1, heads, 1) * x
    CB = mx.repeat(
        mx.swapaxes(C, 1, 2) @ mx.transpose(B, (0, 2, 3, 1)), repeat, axis=1
    )  # [rows, heads, 1, 1]
    decayed = dtx
    if mask is not None:
        dtA = dtA * mask[..., None]
        keep = mx.exp(mx.where(mask, 0.0, -float("inf"))).reshape(rows, 1, 1, 1)
        CB, decayed = CB * keep, dtx * keep
    y = CB.reshape(rows, 1, heads, 1) * dtx
    state_in = decayed.reshape(rows, heads, head_dim, 1) * mx.repeat(B, repeat, axis=2).reshape(
        rows, heads, 1, size
    )
    decay = mx.exp(dtA)  # [rows, 1, heads]
    state_out = state_in + decay[:, -1, :, None, None] * state
    previous = state.reshape(rows, 1, groups, repeat, head_dim, size) @ C.reshape(rows, 1, groups, 1, size, 1)
    y = y + decay[..., None] * previous.squeeze(-1).flatten(2, 3)
    return y.astype(x.dtype) + x * D.reshape(1, 1, heads, 1), state_out


# mlx-lm layer class -> its capturing subclass (merged into melix_mlx.runtime.capture.CAPTURING)
CAPTURING: dict[type, type] = {nemotron_h.NemotronHMamba2Mixer: CapturingMamba2Mixer}
