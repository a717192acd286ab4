"""Speculative-sampling acceptance on the device: the rule that keeps sampled output exact.

Rules of this module:
- Accept draft j with probability min(1, p(d_j) / q(d_j)) using ONE INDEPENDENT uniform per
  position (a uniform shared across positions biases the output distribution for k >= 2);
  at the first rejection draw from normalise(max(p - q, 0)); after k acceptances draw the
  bonus from p. This is what makes the emitted tokens follow the target distribution.
- Lazy and sync-free: it builds graph nodes the engine evaluates with the rest of the cycle.
- Greedy acceptance (an argmax compare over the whole batch) lives in the engine's graph.
- A row that ends within a cycle keeps at most `RowPlan.keep` drafts (`cap_accepted`).
"""

from __future__ import annotations

import mlx.core as mx

from .engine_records import RowPlan
from .sampling import SamplingParams, probabilities


def accept_sampled(
    drafts: mx.array, q: mx.array, logprobs: mx.array, params: SamplingParams
) -> tuple[mx.array, mx.array]:
    """Speculative-sampling acceptance for one row, on the device.

    drafts [k], q [k, V] (what each draft was drawn from), logprobs [k + 1, V] (the
    target's processed log-probabilities). Accept draft j with probability
    min(1, p(d_j) / q(d_j)), one independent uniform per position; at the first
    rejection draw from normalise(max(p - q, 0)); after k acceptances draw from p.
    Returns (accept count, next token), both scalars.
    """
    k = drafts.shape[0]
    p = probabilities(logprobs, params)  # [k + 1, V]
    idx = drafts.astype(mx.int32)[:, None]
    p_d = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,))
    accepted = mx.cumprod((u * q_d < p_d).astype(mx.int32)).sum()
    # q padded with a zero row: at a == k the residual is p[k] itself
    q_pad = mx.concatenate([q, mx.zeros((1, q.shape[-1]), q.dtype)], axis=0)
    p_a = mx.take(p, accepted, axis=0)
    residual = mx.maximum(p_a - mx.take(q_pad, accepted, axis=0), 0.0)
    total = residual.sum()
    # p == q makes the residual empty (rejection had probability 0): guard round-off with p
    dist = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p_a)
    return accepted, mx.random.categorical(mx.log(dist))


def cap_accepted(
    plans: list[RowPlan], ks: list[int], K: int, drafts: mx.array, accepted: mx.array, bonus: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """Accepted drafts that are emitted [B], drafts kept [B] and the token after them
    [B], for rows whose plan caps the drafts they keep (RowPlan.keep).

    An accepted draft past a row's cap is the target's own token there (its argmax, or
    a sample the speculative rule accepted), so it becomes the row's last token: the
    row emits at most cap + 1 drafts, and only those count as accepted.
    """
    caps = [k if p.keep is None else min(p.keep, k) for p, k in zip(plans, ks)]
    if caps == list(ks):
        return accepted, accepted, bonus
    cap = mx.array(caps)
    over = accepted > cap
    at_cap = mx.take_along_axis(drafts, mx.minimum(cap, K - 1)[:, None], axis=1)[:, 0]
    emitted = mx.minimum(accepted, cap + 1)
    return emitted, mx.where(over, cap, accepted), mx.where(over, at_cap.astype(bonus.dtype), bonus)
