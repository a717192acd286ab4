"""The parts of mlx-lm's `BatchGenerator` surface that servers drive, for MTPBatchGenerator.

Rules of this module:
- `BatchSurface` is a mixin of `melix_mlx.batch_generator.MTPBatchGenerator`; it holds
  no decoding logic, only the surface around it: mlx-lm's counters (`stats`), the cache
  views, `extract_cache`, `insert_segments`, `close` (restores the wired limit set at
  construction, as mlx-lm's generator does), `prompt_cache_nbytes`, the segment stage of
  prefill, per-request failure isolation, and the hooks a server wrapping the generator
  drives (melix_mlx.serve.runtime: `next_uid`, `reserve_uid`, `prompt_tokens`, `end_all`).
- Segments: `insert_segments` keeps a request's prompt segments apart. Each `next()`
  prefills at most ONE pending non-final segment per queued request into the request's
  own cache and reports it as a prompt response with `end_of_segment` and not
  `end_of_prompt`; until the following `next()` the request is held back from admission,
  so `extract_cache(uid)` returns a copy of the cache at exactly that boundary (a server
  stores it as a reusable prefix). The hidden states of every prefilled segment are kept
  with the request, so the MTP head is primed from the whole prompt, as without segments.
  The last segment is prefilled at admission as a plain prompt is: chunking equals
  mlx-lm's (each segment in `prefill_step_size` chunks, the last token alone).
- Prompt caches in: a request's cache (with `all_tokens`, the tokens it already holds)
  continues from there. A prompt the cache already holds entirely gives its last token
  back (the cache is trimmed by one) so that token is fed again for the next logits; a
  cache that cannot be trimmed makes that a ValueError. The head cache is not part of a
  prompt cache: the head is primed from the uncached suffix only, which can lower
  acceptance on the first cycles and never changes a token (verification is exact).
- Failures: an exception while prefilling one request drops that request only; the other
  joining rows are admitted and the batch stays consistent. At the end of that `next()`
  `on_failures` runs; by default it raises `RequestFailed` carrying every failure and the
  call's responses (nothing is lost). A server overrides it to answer those requests.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.generate_utils import BatchCountersSnapshot, BatchStats
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import maybe_set_recommended_wired_limit

from melix_fsm import lifecycle as lc
from melix_fsm.batch import Batch, Operation
from melix_fsm.errors import MelixError
from melix_fsm.lifecycle import Signal

from ..runtime.hidden import forward_with_hidden
from .batch_rows import InsertRequest


class RequestFailed(MelixError):
    """One or more requests failed while being prefilled; the others continue."""

    def __init__(self, failures: dict[int, BaseException], responses: tuple[list, list]) -> None:
        detail = "; ".join(f"{uid}: {type(e).__name__}: {e}" for uid, e in failures.items())
        super().__init__(f"requests failed and were dropped ({detail})")
        self.failures = failures
        self.responses = responses


def feed_segment(model: Any, tokens: list[int], cache: list[Any], step_size: int) -> mx.array:
    """Prefill a whole non-final segment in `step_size` chunks; its hidden states [n, D]."""
    hiddens = []
    for start in range(0, len(tokens), step_size):
        _, h = forward_with_hidden(model, mx.array(tokens[start : start + step_size])[None], cache)
        mx.eval(h, [c.state for c in cache])
        hiddens.append(h[0])
    return mx.concatenate(hiddens, axis=0)


class BatchSurface:
    """Mixin: mlx-lm's server-facing BatchGenerator surface; see the module rules."""

    # provided by MTPBatchGenerator
    model: Any
    engine: Any
    steps: Any
    batch: Batch
    refusal: str | None
    controller: Any
    row_forwards: int
    prefill_batch_size: int
    prefill_step_size: int
    max_kv_size: int | None
    _queue: Any
    _stream: Any
    _counters: Any
    _uid_count: int
    insert: Callable[..., list[int]]
    _apply_signals: Callable[..., None]
    _filter: Callable[[list[int]], None]

    def _init_surface(self) -> None:
        self._old_wired_limit = maybe_set_recommended_wired_limit()
        self._held: set[int] = set()  # reported a segment boundary in the latest next()
        self._failures: dict[int, BaseException] = {}

    # -- mlx-lm surface --------------------------------------------------------------
    @property
    def cache(self) -> list[Any]:
        return self.engine.cache

    @property
    def head_cache(self) -> list[Any]:
        return self.engine.head_cache

    @property
    def target_forwards(self) -> int:
        return self.engine.target_forwards

    @property
    def replay_forwards(self) -> int:
        return self.engine.replay_forwards

    @property
    def head_forwards(self) -> int:
        return self.engine.head_forwards

    @property
    def stream(self) -> Any:
        return self._stream

    @contextlib.contextmanager
    def stats(self) -> Iterator[BatchStats]:
        stats = BatchStats()
        start = BatchCountersSnapshot(**asdict(self._counters))
        try:
            yield stats
        finally:
            end = BatchCountersSnapshot(**asdict(self._counters))
            stats += BatchCountersSnapshot.between(start, end)

    def speculative_stats(self) -> dict[str, Any]:
        """Batch totals of the lifecycle counters (retired rows included) and forward counts."""
        out = self.batch.totals().summary()
        out.update(
            target_forwards=self.target_forwards,
            replay_forwards=self.replay_forwards,
            row_forwards=self.row_forwards,
            head_forwards=self.head_forwards,
            abandoned_steps=self.engine.abandoned_steps,
            refusal=self.refusal,
            policy=self.controller.summary() if self.controller is not None else None,
        )
        return out

    def extract_cache(self, uids: Any) -> dict[int, tuple[list[Any], list[int]]]:
        out = {}
        for r in self._queue:
            if r.uid in uids:
                out[r.uid] = self._queued_cache(r)
        self.steps.drop_cycle_ahead()  # its rollback is not settled: the caches are read after it
        ahead = self.steps.ahead is not None  # a plain step running ahead already fed each row's y
        for i, row in enumerate(self.batch):
            if row.uid in uids:
                tokens = list(row.payload.context) + ([row.payload.y] if ahead else [])
                out[row.uid] = ([c.extract(i) for c in self.cache], tokens)
        return out

    # -- hooks for a server wrapping the generator (melix_mlx.serve.runtime) ---------------
    @property
    def next_uid(self) -> int:
        """The uid the next inserted request gets."""
        return self._uid_count

    def reserve_uid(self) -> int:
        """A uid for a request that never joins (its insert failed): uids stay unique."""
        uid = self._uid_count
        self._uid_count += 1
        return uid

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens processed since the generator was built (mlx-lm's counter)."""
        return self._counters.prompt_tokens

    def end_all(self, reason: str) -> list[Any]:
        """Finish every row at once, e.g. when the batched step itself failed: a step in
        flight is undone first, each row gets its finish event (with `reason`), the batch
        empties. Returns the uids that left."""
        uids = list(self.batch.uids)
        with contextlib.suppress(RuntimeError):  # a plain step across a reshape only settles
            self.steps.abandon_ahead()
        with contextlib.suppress(Exception):  # rows may be mid-cycle: they leave regardless
            ended = Signal(event=lc.FINISH.event, reason=reason)
            self._apply_signals(Operation.finish, {uid: ended for uid in uids})
        self._filter([])
        return uids

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Undo a step launched ahead and restore the wired limit set at construction."""
        with contextlib.suppress(RuntimeError):  # a plain step of since-filtered rows
            self.steps.abandon_ahead()
        if getattr(self, "_old_wired_limit", None) is not None:
            mx.synchronize(self._stream)
            mx.set_wired_limit(self._old_wired_limit)
            self._old_wired_limit = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- insertion -------------------------------------------------------------------
    def insert_segments(
        self,
        segments: list[list[list[int]]],
        max_tokens: list[int] | None = None,
        caches: list[list[Any]] | None = None,
        all_tokens: list[list[int]] | None = None,
        samplers: list[Any] | None = None,
        logits_processors: list[list[Any]] | None = None,
        stop_sequences: list[Any] | None = None,
        num_draft_tokens: list[int] | None = None,
    ) -> list[int]:
        """`insert` with each prompt given as segments (prefix boundaries kept apart)."""
        kept = [[list(s) for s in seq if len(s)] for seq in segments]
        all_tokens = [list(t) for t in all_tokens] if all_tokens is not None else None
        for i, seq in enumerate(kept):
            if not seq and caches and caches[i] and all_tokens and all_tokens[i]:
                kept[i] = [[self._give_back_last(caches[i], all_tokens, i)]]
        prompts = [[t for s in seq for t in s] for seq in kept]
        uids = self.insert(  # type: ignore[attr-defined]
            prompts, max_tokens, caches, all_tokens, samplers, logits_processors, stop_sequences,
            num_draft_tokens,
        )
        by_uid = {r.uid: r for r in self._queue}
        for uid, seq in zip(uids, kept):
            if len(seq) > 1:
                request = by_uid[uid]
                request.segments = seq[:-1]
                request.prompt = seq[-1]
        return uids

    @staticmethod
    def _give_back_last(cache: list[Any], all_tokens: list[list[int]], i: int) -> int:
        """A fully cached prompt: the cache gives back its last token, which is fed again."""
        if not can_trim_prompt_cache(cache):
            raise ValueError(f"prompt {i} is fully cached in a cache that cannot be trimmed")
        trim_prompt_cache(cache, 1)
        return all_tokens[i].pop()

    @property
    def prompt_cache_nbytes(self) -> int:
        queued = sum(c.nbytes for r in self._queue if r.cache for c in r.cache)
        return queued + sum(c.nbytes for c in self.cache) + sum(c.nbytes for c in self.head_cache)

    def _queued_cache(self, request: InsertRequest) -> tuple[list[Any] | None, list[int]]:
        """A queued request's cache and tokens; a copy, since its prefill goes on in place."""
        return (copy.deepcopy(request.cache) if request.cache else request.cache), list(request.all_tokens)

    # -- the segment stage -----------------------------------------------------------
    def _prefill_segments(self) -> list[PromptProcessingBatch.Response]:
        """Prefill one pending segment of up to `prefill_batch_size` queued requests."""
        self._held = set()
        responses = []
        for request in [r for r in self._queue if r.segments][: self.prefill_batch_size]:
            segment = request.segments.pop(0)
            try:
                if request.cache is None:
                    request.cache = make_prompt_cache(self.model, self.max_kv_size)
                self._counters.prompt_tokens += len(segment)
                hidden = feed_segment(self.model, segment, request.cache, self.prefill_step_size)
            except Exception as exc:  # this request only: it leaves the queue
                self._fail(request, exc)
                continue
            request.hiddens.append(hidden)
            request.prefilled.extend(segment)
            request.all_tokens.extend(segment)
            self._held.add(request.uid)
            total = len(request.all_tokens) + sum(map(len, request.segments)) + len(request.prompt)
            progress = (len(request.all_tokens), total)
            responses.append(PromptProcessingBatch.Response(request.uid, progress, True, False))
        return responses

    def _pop_ready(self, n: int) -> list[InsertRequest]:
        """Take up to `n` queued requests whose remaining prompt is one segment."""
        ready = [r for r in self._queue if not r.segments and r.uid not in self._held][: max(n, 0)]
        if ready:
            taken = {r.uid for r in ready}
            self._queue = type(self._queue)(r for r in self._queue if r.uid not in taken)
        return ready

    # -- failures --------------------------------------------------------------------
    def _fail(self, request: InsertRequest, exc: BaseException) -> None:
        self._queue = type(self._queue)(r for r in self._queue if r.uid != request.uid)
        self._failures[request.uid] = exc

    def _drain_failures(self, responses: tuple[list, list]) -> None:
        if self._failures:
            failures, self._failures = self._failures, {}
            self.on_failures(failures, responses)

    def on_failures(self, failures: dict[int, BaseException], responses: tuple[list, list]) -> None:
        """Called at the end of a `next()` in which requests failed; see the module rules."""
        raise RequestFailed(failures, responses)
