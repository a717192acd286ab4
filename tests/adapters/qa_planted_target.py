"""Foreign targets for `melix-fsm qa` tests, plugged in by import path as a user would.

Rules of this file:
- `crashes_when_all_finished`: mlx-lm's own BatchGenerator with one bug planted: after a
  step that retires every row it "prepares the next step" from row 0 and crashes.
- `greedy_stream`: a single-sequence, stream_generate-like factory (mlx-lm's
  `generate_step`), run through the kit's stream surface.
- `greedy_only`: a batch factory without a `temperature` keyword (cannot be sampled).
- `not_a_generator`: returns something with no generator surface (a usage error).
- `old_style`: a 0.31-style surface (`state_machines=`); on mlx-lm 0.32 its default stop
  builder is unavailable, which the command reports as a usage error.
- `accept_with_one_uniform`: the cycle engine's sampled acceptance with one uniform
  shared by every draft of a cycle (the planted bias of the slow distribution test).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from melix_mlx.sampling import make_sampler, probabilities
from mlx_lm.generate import BatchGenerator, generate_step


class CrashesWhenAllFinished(BatchGenerator):
    def next(self) -> Any:
        had_rows = len(self._generation_batch) > 0
        out = super().next()
        if had_rows and len(self._generation_batch) == 0:
            self._prepare_next_step()
        return out

    def _prepare_next_step(self) -> int:
        return self._generation_batch.uids[0]  # the planted bug: no row is left


def crashes_when_all_finished(model: Any, temperature: float = 0.0) -> Any:
    return CrashesWhenAllFinished(
        model, sampler=make_sampler(temp=temperature), prefill_batch_size=2, completion_batch_size=3
    )


def greedy_stream(model: Any) -> Any:
    def stream(prompt: list[int], max_tokens: int) -> Any:
        return generate_step(mx.array(prompt), model, max_tokens=max_tokens)

    return stream


def greedy_only(model: Any) -> Any:
    return BatchGenerator(model, prefill_batch_size=2, completion_batch_size=3)


def not_a_generator(model: Any) -> Any:
    return 42


def accept_with_one_uniform(drafts: mx.array, q: mx.array, logprobs: mx.array, params: Any) -> Any:
    k = drafts.shape[0]
    p = probabilities(logprobs, params)
    idx = drafts.astype(mx.int32)[:, None]
    p_d = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    u = mx.broadcast_to(mx.random.uniform(shape=(1,)), (k,))  # the bias: one uniform for all drafts
    accepted = mx.cumprod((u * q_d < p_d).astype(mx.int32)).sum()
    q_pad = mx.concatenate([q, mx.zeros((1, q.shape[-1]), q.dtype)], axis=0)
    p_a = mx.take(p, accepted, axis=0)
    residual = mx.maximum(p_a - mx.take(q_pad, accepted, axis=0), 0.0)
    total = residual.sum()
    dist = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p_a)
    return accepted, mx.random.categorical(mx.log(dist))


class OldStyle:
    """A 0.31-style surface (stops as `state_machines=`), wrapping mlx-lm 0.32's generator."""

    def __init__(self, model: Any) -> None:
        self.inner = BatchGenerator(model, prefill_batch_size=2, completion_batch_size=3)

    def insert(self, prompts: list[list[int]], max_tokens: list[int], state_machines: list[Any]) -> list[int]:
        return self.inner.insert(prompts, max_tokens)

    def next(self) -> Any:
        return self.inner.next()

    def remove(self, uids: list[int]) -> None:
        self.inner.remove(uids)


def old_style(model: Any) -> Any:
    return OldStyle(model)
