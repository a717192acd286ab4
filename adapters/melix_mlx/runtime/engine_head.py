"""The MTP head's side of the cycle engine (melix_mlx.runtime.engine): reading the head at one
slot, drawing drafts, feeding a prompt's pairs, and stacking rows' pending pairs.

Rules of this module:
- Pure graph building over mlx arrays: lazy, no sync except where a long prompt is fed in
  chunks (each chunk's head cache is evaluated before the next is built, as the prefill
  feeds the model). The engine counts forwards, agrees tokens across ranks and keeps the
  rows' head state.
- Head-slot convention (melix_mlx.runtime.engine): pair j joins the main model's hidden h_j with
  token t_{j+1} and predicts t_{j+2}; only the slot a draft is read at is projected to
  the vocabulary.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .engine_records import RowHead
from .sampling import SamplingParams, normalize_logits, probabilities, sample_from


def head_at(
    head: nn.Module, hidden: mx.array, tokens: mx.array, cache: list[Any], at: mx.array
) -> tuple[mx.array, mx.array]:
    """The head over `tokens` [B, L]: (logits [B, V], head_hidden [B, 1, D]) at slot `at` [B].

    A head with `at_slot` (every family head, the controlled draft source) computes only
    what that slot needs past the cache writes; one without (a draft model in the head
    slot) is called whole and sliced.
    """
    index = at.astype(mx.int32).reshape(-1, 1, 1)
    at_slot = getattr(head, "at_slot", None)
    if at_slot is None:
        logits, out = head(hidden, tokens, cache)
        return mx.take_along_axis(logits, index, axis=1)[:, 0], mx.take_along_axis(out, index, axis=1)
    return at_slot(hidden, tokens, cache, index)


def draw(logits: mx.array, params: list[SamplingParams | None]) -> tuple[mx.array, list[mx.array | None]]:
    """Draft tokens [B] from head logits [B, V] (argmax, or each sampled row's own draw);
    per sampled row also the distribution q [1, V] its draft came from."""
    tokens = mx.argmax(logits, axis=-1)
    qs: list[mx.array | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p is not None and not p.greedy:
            qs[i] = probabilities(normalize_logits(logits[i : i + 1]), p)
            drawn = sample_from(qs[i]).astype(tokens.dtype)
            tokens = mx.where(mx.arange(len(params)) == i, drawn, tokens)
    return tokens, qs


def feed_prompt(
    head: nn.Module,
    head_cache: list[Any],
    hiddens: mx.array,
    pair_tokens: list[int],
    step_size: int,
    scored: int = 0,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Feed a prompt's pairs (h_i, t_{i+1}) into `head_cache` in chunks of `step_size`;
    (logits [1, V], head hidden [1, 1, D]) at the last pair: all a prime draws from. With
    `scored`, also the head's logits [m, V] at the m <= scored slots before the last (each
    drafts a token the prompt holds: melix_mlx.runtime.prompt_score), else None."""
    tokens = mx.array(pair_tokens)
    start, n = 0, hiddens.shape[0]
    while n - start > step_size:
        end = start + step_size
        # the chunk's logits are never evaluated, so never computed
        head(hiddens[None, start:end], tokens[None, start:end], head_cache)
        mx.eval([c.state for c in head_cache])
        start = end
    rest_h, rest_t = hiddens[None, start:], tokens[None, start:]
    m = min(scored, n - start - 1)
    if m <= 0:
        logits, hidden = head_at(head, rest_h, rest_t, head_cache, mx.array([n - start - 1]))
        return logits, hidden, None
    trunk = getattr(head, "trunk", None)
    if trunk is None:  # a draft model in the head slot projects every slot anyway
        every, out = head(rest_h, rest_t, head_cache)
        return every[:, -1], out[:, -1:], every[0, -m - 1 : -1]
    out = trunk(rest_h, rest_t, head_cache)
    return head.logits(out[:, -1:])[:, 0], out[:, -1:], head.logits(out[0, -m - 1 : -1])


def stack_pending(rows: list[RowHead], stale: list[int]) -> tuple[mx.array, mx.array, list[int]]:
    """Every row's pending pairs right-padded to the longest: hiddens [B, W, D], tokens
    [B, W] and each row's real count (rows without pending pairs are all padding)."""
    width = max(len(rows[i].pending_t) for i in stale)
    dim = rows[stale[0]].pending_h[0].shape[-1]
    dtype = rows[stale[0]].pending_h[0].dtype
    hs, ts, real = [], [], []
    for row in rows:
        n = len(row.pending_t)
        pad = width - n
        h = mx.concatenate(row.pending_h, axis=0) if n else mx.zeros((0, dim), dtype)
        t = mx.concatenate(row.pending_t).astype(mx.uint32) if n else mx.zeros((0,), mx.uint32)
        hs.append(mx.concatenate([h, mx.zeros((pad, dim), dtype)]) if pad else h)
        ts.append(mx.concatenate([t, mx.zeros((pad,), mx.uint32)]) if pad else t)
        real.append(n)
    return mx.stack(hs), mx.stack(ts), real
