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
- `five_bugs` (and `only_<bug>` for each): mlx-lm's BatchGenerator behind a wrapper that
  plants, as seen from the outside, the five bug classes a public fork's batched MTP
  had (`PLANTED`): every row finishing crashes; removing a request before its first
  token crashes; a row joining a batch whose rows have decoded a few steps (where a
  speculative fork has rejected drafts, so rows sit at different offsets) gets wrong
  later tokens; a ragged prefill (rows joining together with prompts of different
  lengths) gives the shorter ones a wrong first token; and, only when sampling, a row
  finishing while others continue crashes the per-row sampler filter.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from melix_mlx.runtime.sampling import make_sampler, probabilities
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


PLANTED = ("all_finished", "early_remove", "join_after_decode", "ragged_prefill", "sampler_filter")


class FiveBugs:
    """mlx-lm's BatchGenerator with some of `PLANTED` planted at its surface (see the file rules)."""

    def __init__(self, model: Any, temperature: float, bugs: tuple[str, ...]) -> None:
        self.inner = BatchGenerator(
            model, sampler=make_sampler(temp=temperature), prefill_batch_size=2, completion_batch_size=3
        )
        self.bugs = set(bugs)
        self.sampling = temperature > 0
        self.count: dict[int, int] = {}
        self.length: dict[int, int] = {}
        self.stale: set[int] = set()

    def insert(
        self, prompts: list[list[int]], max_tokens: list[int], stop_sequences: Any = None
    ) -> list[int]:
        uids = self.inner.insert(prompts, max_tokens, stop_sequences=stop_sequences)
        for uid, prompt in zip(uids, prompts):
            self.count[uid], self.length[uid] = 0, len(prompt)
        return uids

    def remove(self, uids: list[int]) -> None:
        if "early_remove" in self.bugs and any(self.count[u] == 0 for u in uids):
            self._drop_pending(uids)
        self.inner.remove(uids)
        for uid in uids:
            self.count.pop(uid, None)

    def _drop_pending(self, uids: list[int]) -> None:
        raise KeyError(uids[0])  # the planted bug: a request without a first token has no row yet

    def next(self) -> list[Any]:
        before = {u for u, n in self.count.items() if n > 0}
        responses = self.inner.next()[1]
        joiners = [r.uid for r in responses if self.count.get(r.uid) == 0]
        decoded = any(self.count[u] >= 2 for u in before)
        out = []
        for r in responses:
            token, uid = int(r.token), r.uid
            if uid in joiners and "join_after_decode" in self.bugs and decoded:
                self.stale.add(uid)
            lengths = {self.length[u] for u in joiners}
            short = "ragged_prefill" in self.bugs and len(lengths) > 1 and self.length[uid] < max(lengths)
            if (uid in joiners and short) or (uid in self.stale and self.count[uid] >= 1):
                token ^= 1  # the planted wrong token
            self.count[uid] += 1
            out.append(SimpleNamespace(uid=uid, token=token, finish_reason=r.finish_reason))
        finished = {r.uid for r in responses if r.finish_reason is not None}
        for uid in finished:
            self.count.pop(uid, None)
        if "sampler_filter" in self.bugs and self.sampling and finished and self.count:
            self.filter()
        if "all_finished" in self.bugs and before and not self.count:
            self._prepare_next_step()
        return out

    def filter(self) -> None:
        samplers = None  # the planted bug: the batch started empty, so it has no per-row samplers
        samplers[0]  # noqa: B018

    def _prepare_next_step(self) -> None:
        raise IndexError("list index out of range")  # the planted bug: no row is left


def five_bugs(model: Any, temperature: float = 0.0) -> Any:
    return FiveBugs(model, temperature, PLANTED)


def _only(bug: str) -> Any:
    def factory(model: Any, temperature: float = 0.0) -> Any:
        return FiveBugs(model, temperature, (bug,))

    factory.__name__ = f"only_{bug}"
    return factory


for _bug in PLANTED:
    globals()[f"only_{_bug}"] = _only(_bug)


STOPS_BUILT: list[list[tuple[int, ...]]] = []  # every call of counting_stops, for the test


def counting_stops(stops: list[tuple[int, ...]]) -> Any:
    """A `--stops` builder: mlx-lm's StopSequences, recording each call."""
    from mlx_lm.generate import StopSequences

    STOPS_BUILT.append([tuple(s) for s in stops])
    return StopSequences([list(s) for s in stops] or None)
