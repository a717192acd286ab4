"""Batched MTP: a drop-in for mlx-lm's `BatchGenerator` where every row drafts and verifies.

Rules of this module:
- Same surface as `mlx_lm.generate.BatchGenerator` (0.32): `insert`, `remove`, `next`,
  `next_generated`, `stats`, `close`, `extract_cache`. One `next()` may return several
  responses for the same uid (every token a verify accepted, in order); each response
  carries `from_draft`, and a finishing response carries the row's speculative stats.
- Row i of `self.batch` (a melix_fsm Batch) is row i of the main cache and of the head
  cache. Joining rows are prefilled alone (which also primes their head cache from the
  prompt) and appended with `extend`; leaving rows go with one `filter`. A row's
  speculative state (pending head pairs, draft count, sampler, counters, lifecycle
  machine) lives in its Batch row and travels through both reshapes untouched.
- One step = at most one batched head catch-up forward, k - 1 chained head forwards, one
  batched verify forward, and (only for models with recurrent layers, when a row rejected)
  one ragged replay. Rows that do not speculate (refused, suspended, faulted) ride in the
  same verify forward as plain decode: their draft slots are padding, rolled back.
- Rollback is per row (melix_mlx.batch_cache): no row's rollback touches another row.
- Lifecycle: every admit/refuse, draft, verify, verified, plain step, suspend/resume,
  fault and finish is applied to the Batch; `last_report` (melix_fsm.report.StepReport)
  holds what each row went through in the latest `next()`: the event-reporting contract
  the conformance kit checks.
- Device policy: an optional `ActivationController` (melix_fsm.policy) is fed every step's
  batch size and verify outcomes; its suspend / resume actions become lifecycle events
  for every row at a cycle boundary. Without one, speculation stays on.
- Faults: an exception in the head or verify forward faults the rows that were
  speculating; caches are restored and they continue as plain decode. No token is lost.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    PromptProcessingBatch,
    StopSequences,
    _extend_cache,
    _merge_caches,
)
from mlx_lm.generate_utils import BatchCounters, BatchCountersSnapshot, BatchStats
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from melix_fsm import lifecycle as lc
from melix_fsm.batch import Batch, Row
from melix_fsm.lifecycle import Signal, State
from melix_fsm.policy import Action, ActivationController
from melix_fsm.report import RowReport, StepReport

from . import rollback
from .batch_cache import arrays_checkpoint, drop_row_suffixes, ragged_forward, rollback_rows
from .batch_rows import InsertRequest, MTPResponse, RowState
from .hidden import forward_with_hidden
from .prefill import prefill_with_hidden
from .sampling import (
    accept_greedy,
    accept_sampled,
    normalize_logits,
    params_of,
    probabilities,
    sample_from,
)

_CYCLE_READY = frozenset({State("admitted"), State("accepted"), State("rolled_back")})
_HEAD_DEAD = frozenset({State("refused"), State("faulted"), State("finished")})


class MTPBatchGenerator:
    """Continuous batching with MTP speculation in every row; see the module rules."""

    def __init__(
        self,
        model: nn.Module,
        head: nn.Module | None,
        *,
        num_draft_tokens: int = 1,
        max_tokens: int = 128,
        stop_tokens: Sequence[Sequence[int]] | None = None,
        sampler: Any = None,
        logits_processors: list[Any] | None = None,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
        max_kv_size: int | None = None,
        stream: Any = None,
        refusal: str | None = None,
        controller: ActivationController | None = None,
    ) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.model = model
        self.head = head
        self.num_draft_tokens = num_draft_tokens
        self.max_tokens = max_tokens
        self.sampler = sampler or greedy_sampler
        self.logits_processors = logits_processors or []
        self.completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.prefill_batch_size = prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.max_kv_size = max_kv_size
        self._stream = stream or mx.default_stream(mx.default_device())
        self._default_stop = StopSequences(stop_tokens if stop_tokens else None)
        self.refusal = refusal or ("no MTP head loaded" if head is None else None)
        if self.refusal is None:
            bad = rollback.unsupported_kinds(make_prompt_cache(model, max_kv_size))
            if bad:
                self.refusal = f"cache kinds without exact rollback: {', '.join(bad)}"
        self.batch = Batch()
        self.cache: list[Any] = []
        self.head_cache: list[Any] = []
        self._queue: deque[InsertRequest] = deque()
        self._uid_count = 0
        self._counters = BatchCounters()
        self.target_forwards = 0  # batched verify / plain forwards
        self.replay_forwards = 0  # batched ragged replays (recurrent layers only)
        self.row_forwards = 0  # target and replay forwards counted once per row they served
        self.head_forwards = 0
        self.controller = controller
        self.last_report = StepReport()
        self._events: dict[Any, list[Signal]] = {}
        self._emitted: dict[Any, list[int]] = {}
        self._joined: list[Any] = []
        self._left: list[Any] = []
        self._first_logprobs: dict[int, mx.array] = {}
        self._retired_counters: dict[Any, Any] = {}

    # -- mlx-lm surface --------------------------------------------------------------
    @property
    def stream(self) -> Any:
        return self._stream

    def close(self) -> None:
        """Nothing to release (kept for BatchGenerator parity)."""

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
            refusal=self.refusal,
            policy=self.controller.summary() if self.controller is not None else None,
        )
        return out

    def insert(
        self,
        prompts: list[list[int]],
        max_tokens: list[int] | None = None,
        caches: list[list[Any]] | None = None,
        all_tokens: list[list[int]] | None = None,
        samplers: list[Any] | None = None,
        logits_processors: list[list[Any]] | None = None,
        stop_sequences: list[StopSequences] | None = None,
        num_draft_tokens: list[int] | None = None,
    ) -> list[int]:
        n = len(prompts)
        options = {
            "max_tokens": max_tokens or [self.max_tokens] * n,
            "caches": caches or [None] * n,
            "all_tokens": all_tokens or [[] for _ in range(n)],
            "samplers": [s or self.sampler for s in (samplers or [None] * n)],
            "logits_processors": [
                tuple(lp) if lp else () for lp in (logits_processors or [self.logits_processors] * n)
            ],
            "stop_sequences": stop_sequences or [self._default_stop] * n,
            "num_draft_tokens": num_draft_tokens or [self.num_draft_tokens] * n,
        }
        for name, values in options.items():
            if len(values) != n:
                raise ValueError(f"option {name} needs one entry per prompt: {n} != {len(values)}")
        requests = []
        for i, prompt in enumerate(prompts):
            uid = self._uid_count + i
            if not prompt:
                raise ValueError(f"sequence {uid} has an empty prompt")
            if options["max_tokens"][i] <= 0:
                raise ValueError(f"sequence {uid}'s max_tokens must be > 0")
            if options["num_draft_tokens"][i] < 1:
                raise ValueError(f"sequence {uid}'s num_draft_tokens must be >= 1")
            requests.append(
                InsertRequest(
                    uid,
                    list(prompt),
                    options["max_tokens"][i],
                    options["caches"][i],
                    list(options["all_tokens"][i]),
                    options["samplers"][i],
                    options["logits_processors"][i],
                    options["stop_sequences"][i],
                    options["num_draft_tokens"][i],
                )
            )
        self._queue.extend(requests)
        self._uid_count += n
        return [r.uid for r in requests]

    def remove(self, uids: Sequence[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        wanted = set(uids)
        caches = self.extract_cache(wanted) if return_prompt_caches else {}
        self._queue = deque(r for r in self._queue if r.uid not in wanted)
        leaving = [uid for uid in self.batch.uids if uid in wanted]
        if leaving:
            self.batch.finish(leaving, reason="removed")
            self._filter([i for i, uid in enumerate(self.batch.uids) if uid not in wanted])
        return caches

    def extract_cache(self, uids: Any) -> dict[int, tuple[list[Any], list[int]]]:
        out = {}
        for r in self._queue:
            if r.uid in uids:
                out[r.uid] = (r.cache, r.all_tokens)
        for i, row in enumerate(self.batch):
            if row.uid in uids:
                out[row.uid] = ([c.extract(i) for c in self.cache], list(row.payload.context))
        return out

    @property
    def prompt_cache_nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) + sum(c.nbytes for c in self.head_cache)

    def next(self) -> tuple[list[PromptProcessingBatch.Response], list[MTPResponse]]:
        with mx.stream(self._stream):
            stepped = self.batch.uids
            self._events, self._emitted, self._joined, self._left = {}, {}, [], []
            self._retired_counters = {}  # counters of rows leaving in this call, for the report
            generation: list[MTPResponse] = []
            if len(self.batch):
                tic = time.perf_counter()
                generation = self._step()
                self._apply_policy()
                self._counters.decode_time += time.perf_counter() - tic
                self._counters.generation_tokens += len(generation)
                self._counters.generation_steps += 1
            prompt_responses = self._admit(generation)
            self.last_report = StepReport(
                rows=[
                    RowReport(
                        uid=uid,
                        events=self._events.get(uid, []),
                        emitted=self._emitted.get(uid, []),
                        counters=self._counters_of(uid),
                    )
                    for uid in stepped + self._joined
                ],
                joined=list(self._joined),
                left=list(self._left),
                order=self.batch.uids,
            )
            return prompt_responses, generation

    def _record(self, uid: Any, signal: Signal) -> None:
        self._events.setdefault(uid, []).append(signal)

    def _counters_of(self, uid: Any) -> Any:
        """A snapshot of the row's counters: a report is plain data, not a live view."""
        counters = self.batch.row(uid).counters if uid in self.batch else self._retired_counters.get(uid)
        return counters.copy() if counters is not None else None

    def _apply_policy(self) -> None:
        """Feed the controller this step's outcomes; turn its action into lifecycle events."""
        if self.controller is None or not len(self.batch):
            return
        accepted = proposed = 0
        for signals in self._events.values():
            for signal in signals:
                if signal.event is lc.Event("draft"):
                    proposed += signal.drafts
                elif signal.event is lc.Event("verified"):
                    accepted += signal.accepted
        action = self.controller.update(len(self.batch), accepted, proposed)
        if action is Action.keep:
            return
        reason = self.controller.events[-1].reason if self.controller.events else action.value
        if action is Action.suspend:
            uids = self.batch.suspend(reason=str(reason))
            signal = Signal(event=lc.SUSPEND.event, reason=str(reason))
        else:
            uids = self.batch.resume(reason=str(reason))
            signal = Signal(event=lc.RESUME.event, reason=str(reason))
        for uid in uids:
            self._record(uid, signal)

    def next_generated(self) -> list[MTPResponse]:
        while True:
            prompt_responses, generation = self.next()
            if not generation and prompt_responses:
                continue
            return generation

    # -- admission -------------------------------------------------------------------
    def _admit(self, out: list[MTPResponse]) -> list[PromptProcessingBatch.Response]:
        room = self.completion_batch_size - len(self.batch)
        n = min(self.prefill_batch_size, room, len(self._queue))
        if n <= 0:
            return []
        joining = Batch()
        caches, head_caches, responses = [], [], []
        tic = time.perf_counter()
        for _ in range(n):
            request = self._queue.popleft()
            row, cache, head_cache = self._prefill(request)
            joining.extend([request.uid], payloads=[row])
            resolution = (
                lc.ADMIT if row.refusal is None else Signal(event=lc.REFUSE.event, reason=row.refusal)
            )
            joining.resolve({request.uid: resolution})
            self._record(request.uid, resolution)
            self._joined.append(request.uid)
            caches.append(cache)
            head_caches.append(head_cache)
            self._counters.prompt_tokens += len(request.prompt)
            total = len(request.all_tokens) + len(request.prompt)
            responses.append(PromptProcessingBatch.Response(request.uid, (total, total), True, True))
        self._counters.prompt_time += time.perf_counter() - tic
        self.cache = _extend_cache(self.cache, _merge_caches(caches))
        self.head_cache = _extend_cache(self.head_cache, _merge_caches(head_caches))
        if self.controller is not None and not self.controller.speculating:
            # speculation is suspended batch-wide: joining rows start suspended too
            reason = self.controller.events[-1].reason if self.controller.events else "device_policy"
            for uid in joining.suspend(reason=str(reason)):
                self._record(uid, Signal(event=lc.SUSPEND.event, reason=str(reason)))
        first = len(self.batch)
        self.batch.extend(joining)
        # The first token of each joining row came from its prefill: emit it now.
        finished = []
        for row in self.batch.rows[first:]:
            state: RowState = row.payload
            reason = self._emit(row.uid, state, state.y, self._first_logprobs.pop(row.uid), False, out)
            if reason:
                finished.append(row.uid)
        if finished:
            self._finish(finished, out)
        return responses

    def _prefill(self, request: InsertRequest) -> tuple[RowState, list[Any], list[Any]]:
        cache = request.cache or make_prompt_cache(self.model, self.max_kv_size)
        prompt = mx.array(request.prompt)
        logits, hiddens = prefill_with_hidden(self.model, prompt, cache, self.prefill_step_size)
        context = request.all_tokens + request.prompt
        state = RowState(
            context=context,
            y=0,
            sampler=request.sampler,
            params=params_of(request.sampler),
            processors=request.processors,
            max_tokens=request.max_tokens,
            matcher=request.stop.matcher(),
            k=request.k,
        )
        logprobs = self._process(state, logits, fed=[], upto=1)
        state.y = int(state.sampler(logprobs[0:1]).item())
        self._first_logprobs[request.uid] = logprobs[0]
        state.refusal = self.refusal or (
            None if state.params is not None else "unknown sampler: its distribution cannot be verified"
        )
        head_cache = self.head.make_cache() if self.head is not None else []
        if state.refusal is None:
            # Pairs (h_i, t_{i+1}); all but the last prime the head now, the last waits.
            pair_tokens = request.prompt[1:] + [state.y]
            if len(pair_tokens) > 1:
                self.head(hiddens[None, :-1], mx.array([pair_tokens[:-1]]), head_cache)
                mx.eval([c.state for c in head_cache])
                self.head_forwards += 1
            state.queue(hiddens[-1:], pair_tokens[-1:])
        mx.eval([c.state for c in cache])
        return state, cache, head_cache

    # -- one decode step -------------------------------------------------------------
    def _process(self, state: RowState, logits: mx.array, fed: list[int], upto: int) -> mx.array:
        """Processed log-probs [upto, V]: position j saw context + fed[: j + 1]."""
        logits = logits[:upto]
        if state.processors:
            rows = []
            for j in range(upto):
                history = mx.array(state.context + fed[: j + 1])
                row = logits[j : j + 1]
                for processor in state.processors:
                    row = processor(history, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return normalize_logits(logits)

    def _step(self) -> list[MTPResponse]:
        rows = self.batch.rows
        states: list[RowState] = [row.payload for row in rows]
        spec = [i for i, row in enumerate(rows) if row.state in _CYCLE_READY and states[i].refusal is None]
        k_rows = [0] * len(rows)
        for i in spec:
            remaining = states[i].max_tokens - states[i].num_generated
            k_rows[i] = max(1, min(states[i].k, remaining - 1))
        drafts: mx.array | None = None
        qs: list[mx.array | None] = [None] * len(rows)
        K = max(k_rows) if spec else 0
        if spec:
            try:
                drafts, qs = self._draft(rows, states, spec, k_rows, K)
            except Exception as exc:  # the head failed: those rows continue plainly
                self._fault_rows([rows[i].uid for i in spec], exc)
                spec, K, k_rows, drafts = [], 0, [0] * len(rows), None
            else:
                draft_events = {rows[i].uid: lc.draft(k_rows[i]) for i in spec}
                self.batch.step(draft_events)
                for uid, signal in draft_events.items():
                    self._record(uid, signal)
        return self._verify(rows, states, spec, k_rows, K, drafts, qs)

    def _draft(
        self, rows: tuple[Row, ...], states: list[RowState], spec: list[int], k_rows: list[int], K: int
    ) -> tuple[mx.array, list[mx.array | None]]:
        """Catch every live head row up, then draft K tokens per row: drafts [B, K], lazy.

        Column j of row i is a real draft only for speculating rows with j < k_rows[i];
        the rest is padding the verify rolls back. Drafts stay on the device until the
        verify's single sync.
        """
        B = len(rows)
        alive = [rows[i].state not in _HEAD_DEAD and states[i].pending_tokens for i in range(B)]
        width = max(len(states[i].pending_tokens) for i in spec)
        real = [min(len(states[i].pending_tokens), width) if alive[i] else 0 for i in range(B)]
        dim = next(states[i].pending_hidden.shape[-1] for i in spec)
        dtype = states[spec[0]].pending_hidden.dtype
        hidden_rows, token_rows = [], []
        for i in range(B):
            if real[i]:
                h, t = states[i].take(real[i])
            else:
                h, t = mx.zeros((0, dim), dtype), []
            pad = width - real[i]
            hidden_rows.append(mx.concatenate([h, mx.zeros((pad, dim), dtype)]) if pad else h)
            token_rows.append(t + [0] * pad)
        logits, head_hidden = self.head(mx.stack(hidden_rows), mx.array(token_rows), self.head_cache)
        self.head_forwards += 1
        drop_row_suffixes(self.head_cache, [width - r for r in real])
        last = mx.array([max(r - 1, 0) for r in real])
        step_logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        step_hidden = mx.take_along_axis(head_hidden, last[:, None, None], axis=1)
        sampled = [i for i in spec if not states[i].params.greedy]
        qs: list[list[mx.array]] = [[] for _ in range(B)]
        columns: list[mx.array] = []
        for j in range(K):
            if j > 0:
                logits, step_hidden = self.head(step_hidden, columns[-1][:, None], self.head_cache)
                self.head_forwards += 1
                step_logits = logits[:, 0]
            column = mx.argmax(step_logits, axis=-1)
            for i in sampled:
                if j < k_rows[i]:
                    q = probabilities(normalize_logits(step_logits[i : i + 1]), states[i].params)
                    qs[i].append(q)
                    column = mx.where(mx.arange(B) == i, sample_from(q).astype(column.dtype), column)
            columns.append(column)
        q_arrays = [mx.concatenate(q, axis=0) if q else None for q in qs]
        return mx.stack(columns, axis=1), q_arrays

    def _verify(
        self,
        rows: tuple[Row, ...],
        states: list[RowState],
        spec: list[int],
        k_rows: list[int],
        K: int,
        drafts: mx.array | None,
        qs: list[mx.array | None],
    ) -> list[MTPResponse]:
        B = len(rows)
        spec_set = set(spec)
        inputs = mx.array([[s.y] for s in states], dtype=mx.uint32)
        if drafts is not None:
            inputs = mx.concatenate([inputs, drafts.astype(mx.uint32)], axis=1)
        checkpoint = arrays_checkpoint(self.cache)
        if spec:
            self.batch.step({rows[i].uid: lc.VERIFY for i in spec})
            for i in spec:
                self._record(rows[i].uid, lc.VERIFY)
        try:
            logits, hidden = forward_with_hidden(self.model, inputs, self.cache)
            self.target_forwards += 1
            self.row_forwards += B
            logprobs = normalize_logits(logits)  # rows with logits processors are redone below
            targets = mx.argmax(logprobs, axis=-1)
            mx.eval(targets, inputs)  # the step's one sync
            fed, targets_list = inputs.tolist(), targets.tolist()
            outcomes = []
            for i in range(B):
                n = k_rows[i] + 1 if i in spec_set else 1
                row_drafts = fed[i][1:n]
                row_logprobs, row_targets = logprobs[i], targets_list[i]
                if states[i].processors:
                    row_logprobs = self._process(states[i], logits[i], fed[i], n)
                    row_targets = mx.argmax(row_logprobs, axis=-1).tolist()
                outcomes.append(
                    self._decide(states[i], row_drafts, qs[i], row_logprobs, row_targets, i in spec_set)
                )
        except Exception as exc:
            rollback_rows(self.cache, checkpoint, K + 1, [0] * B)  # undo the whole forward
            if not spec:
                raise  # a plain forward failing is not a speculative fault
            self._fault_rows([rows[i].uid for i in spec], exc)
            return []
        keep = [a + 1 for a, _, _ in outcomes]
        if rollback_rows(self.cache, checkpoint, K + 1, keep):
            kept_rows = [fed[i][: keep[i]] for i in range(B)]
            _, hidden = ragged_forward(
                lambda x, c: forward_with_hidden(self.model, x, c), kept_rows, self.cache
            )
            self.replay_forwards += 1
            self.row_forwards += B
        if K > 1:
            rollback.trim_all(self.head_cache, K - 1)  # the chained, speculative head entries
        step_events: dict[Any, Signal] = {}
        for i in range(B):
            a = outcomes[i][0]
            uid = rows[i].uid
            step_events[uid] = lc.verified(a) if i in spec_set else lc.PLAIN_STEP
        self.batch.step(step_events)
        out: list[MTPResponse] = []
        finished = []
        for i in range(B):
            uid, state = rows[i].uid, states[i]
            a, bonus, row_logprobs = outcomes[i]
            accepted = fed[i][1 : a + 1]
            self._record(uid, step_events[uid])
            state.context.extend(fed[i][: a + 1])
            if rows[i].state not in _HEAD_DEAD:
                state.queue(hidden[i, : a + 1], [*accepted, bonus])
            emitted = [(d, row_logprobs[j], True) for j, d in enumerate(accepted)]
            emitted.append((bonus, row_logprobs[a], False))
            state.y = bonus
            for token, lp, from_draft in emitted:
                if self._emit(uid, state, token, lp, from_draft, out):
                    finished.append(uid)
                    break
        if finished:
            self._finish(finished, out)
        return out

    def _decide(
        self,
        state: RowState,
        drafts: list[int],
        q: mx.array | None,
        logprobs: mx.array,
        targets: list[int],
        speculating: bool,
    ) -> tuple[int, int, mx.array]:
        """(accepted count, token after the accepted prefix, processed log-probs)."""
        if not speculating:
            if state.sampler is greedy_sampler:
                return 0, targets[0], logprobs
            return 0, int(state.sampler(logprobs[0:1]).item()), logprobs
        if state.params.greedy:
            a = accept_greedy(drafts, targets)
            return a, targets[a], logprobs
        a, token = accept_sampled(drafts, q, probabilities(logprobs[: len(drafts) + 1], state.params))
        return a, token, logprobs

    # -- emission, faults, reshaping -------------------------------------------------
    def _emit(
        self, uid: int, state: RowState, token: int, logprobs: mx.array, from_draft: bool, out: list
    ) -> str | None:
        state.num_generated += 1
        reason = "length" if state.num_generated >= state.max_tokens else None
        if state.matcher.advance(token):
            reason = "stop"
        out.append(MTPResponse(uid, token, logprobs, reason, None, None, from_draft))
        self._emitted.setdefault(uid, []).append(token)
        return reason

    def _fault_rows(self, uids: list[Any], exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        signal = Signal(event=lc.FAULT.event, reason=message)
        self.batch.step({uid: signal for uid in uids})
        for uid in uids:
            state: RowState = self.batch.row(uid).payload
            state.fault = message
            state.pending_hidden, state.pending_tokens = None, []
            self._record(uid, signal)

    def _finish(self, uids: list[Any], out: list[MTPResponse]) -> None:
        done = set(uids)
        by_uid = {}
        for i, row in enumerate(self.batch):
            if row.uid in done:
                by_uid[row.uid] = ([c.extract(i) for c in self.cache], list(row.payload.context))
        self.batch.finish(uids)
        for uid in uids:
            self._record(uid, lc.FINISH)
            self._retired_counters[uid] = self.batch.row(uid).counters
        self._left.extend(uids)
        for response in out:
            if response.uid in done and response.finish_reason is not None:
                response.prompt_cache, response.all_tokens = by_uid[response.uid]
                row = self.batch.row(response.uid)
                response.stats = row.counters.summary() | {
                    "state": row.state.value,
                    "refusal": row.payload.refusal,
                    "fault": row.payload.fault,
                }
        self._filter([i for i, uid in enumerate(self.batch.uids) if uid not in done])

    def _filter(self, keep: list[int]) -> None:
        if keep:
            for c in self.cache:
                c.filter(keep)
            for c in self.head_cache:
                c.filter(keep)
        else:
            self.cache, self.head_cache = [], []
        self.batch.filter(keep)
