"""Batched MTP: a drop-in for mlx-lm's `BatchGenerator` where every row drafts and verifies.
(Over 400 lines: admission, the step, its run-ahead and emission share the Batch and the
engine; prompt processing, the server-facing surface, row records and the cycle itself
live in batch_prompts.py, batch_surface.py, batch_rows.py and engine.py.)

Rules of this module:
- Same surface as `mlx_lm.generate.BatchGenerator` (0.32): `insert`, `insert_segments`,
  `remove`, `next`, `next_generated`, `stats`, `close`, `extract_cache`,
  `prompt_cache_nbytes` (the server-facing parts live in melix_mlx.batch_surface).
  One `next()` may return several responses for the same uid (every token a verify
  accepted, in order); each response carries `from_draft`, and a finishing response
  carries the row's speculative stats.
- Row i of `self.batch` (a melix_fsm Batch) is row i of the main cache and of the head
  cache. Joining rows are prefilled (together where nothing of them is cached yet, as
  mlx-lm prefills its prompts; this also primes their head caches from the prompts) and
  appended with `extend`; leaving rows go with one `filter`. A row's
  speculative state (pending head pairs, draft count, sampler, counters, lifecycle
  machine) lives in its Batch row and travels through both reshapes untouched.
- One step is one cycle of melix_mlx.engine (the same code the single-sequence decoder
  runs): k - 1 chained head forwards, one batched verify with acceptance on the device,
  one head catch-up that also drafts the next cycle, one host sync, per-row rollback
  with no replay. Rows that do not speculate (refused, suspended, faulted) ride in the
  same verify as plain decode (their draft slots are padding, rolled back); when no row
  speculates the step is a plain [B, 1] forward.
- Rollback is per row (melix_mlx.rollback, melix_mlx.capture): no row's rollback touches
  another row.
- Lifecycle: every admit/refuse, draft, verify, verified, plain step, suspend/resume,
  fault and finish is applied to the Batch; `last_report` (melix_fsm.report.StepReport)
  holds what each row went through in the latest `next()`: the event-reporting contract
  the conformance kit checks.
- Device policy: an optional `LiveController` (melix_fsm.policy.controller) is fed every
  step's batch size, verify outcomes and seconds; its verdict becomes suspend / resume
  lifecycle events for every row at a cycle boundary. Without one, speculation stays on.
  What a step is worth (`objective`): "throughput" counts every token emitted, right
  while requests wait for rows (a finished row is refilled at once); "drain" counts the
  batch's progress towards its end: B x the drop in the largest budget left (max_tokens
  minus tokens generated) over its rows. A batch nobody refills ends with its longest
  row, so a cycle that moves the other rows and not that one gains nothing, and a
  speculating batch whose rows drift apart pays the tail. "auto" (the default) is drain
  while no request waits, throughput otherwise; a server, which expects arrivals, passes
  "throughput". A draining step also passes that largest budget as `remaining`, so the
  controller runs no probe the batch's end leaves no room to pay for (None otherwise).
- Faults: an exception in the head or verify forward faults the rows that were
  speculating; caches are restored and they continue as plain decode. No token is lost.
"""

from __future__ import annotations

import contextlib
import math
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
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from melix_fsm import lifecycle as lc
from melix_fsm.batch import Batch, Operation, Row
from melix_fsm.lifecycle import Signal, State
from melix_fsm.policy.controller import LiveController
from melix_fsm.reasons import RefusalReason, reason_of, refusal_text
from melix_fsm.report import RowReport, StepReport

from . import head_receipt, ragged_kv, rollback, step_rules
from .batch_prompts import MAX_PADDING, PreparedRow, join_groups, joins_fresh, prepare_row, prepare_rows
from .batch_rows import InsertRequest, MTPResponse, RowState
from .batch_surface import BatchSurface
from .engine import CycleEngine, run_ahead_default
from .engine_records import Flight, PlainStep, RowPlan, Settled, SpeculativeFault
from .prefill import check_prompt

OBJECTIVES = ("auto", "throughput", "drain")  # what a step is worth to the live policy


class MTPBatchGenerator(BatchSurface):
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
        controller: LiveController | None = None,
        kv_bits: int | None = None,
        run_ahead: bool | None = None,
        objective: str = "auto",
    ) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if kv_bits is not None:  # typed, from the registry: mlx-lm cannot merge quantized caches
            from .errors import batched_quantized_kv

            raise batched_quantized_kv()
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
        no_head = refusal_text(RefusalReason.unsupported_model, "no MTP head loaded")
        self.refusal = refusal or (no_head if head is None else head_receipt.refusal(head))
        fresh_cache = make_prompt_cache(model, max_kv_size)
        if self.refusal is None:
            self.refusal = rollback.refusal(fresh_cache, model=model, batched=True)
        # A window's content depends on how a joint prefill is padded: join as mlx-lm does
        windowed = any(isinstance(c, RotatingKVCache) for c in rollback.leaves(fresh_cache))
        self._max_padding = math.inf if windowed else MAX_PADDING
        self.batch = Batch()
        self.engine = CycleEngine(model, head, [], [])  # row i of the engine is row i of the batch
        self._queue: deque[InsertRequest] = deque()
        self._uid_count = 0
        self._counters = BatchCounters()
        self.row_forwards = 0  # target forwards counted once per row they served
        self.controller = controller
        self.objective = objective
        # build step n + 1 before step n syncs (melix_mlx.engine.run_ahead_default: on a GPU)
        self.run_ahead = run_ahead_default() if run_ahead is None else run_ahead
        self.last_report = StepReport()
        self._events: dict[Any, list[Signal]] = {}
        self._emitted: dict[Any, list[int]] = {}
        self._joined: list[Any] = []
        self._left: list[Any] = []
        self._first_logprobs: dict[int, mx.array] = {}
        # the next step, launched before it was due (it carries its plans and rows' uids)
        self._ahead: Flight | PlainStep | None = None
        self._ahead_fault: tuple[SpeculativeFault, list[tuple[Any, int]]] | None = None
        self._last_step_end: float | None = None
        self._admitted_since = False
        self._retired_counters: dict[Any, Any] = {}
        self._init_surface()

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
        if self._ahead is not None:
            with contextlib.suppress(RuntimeError):  # a plain step across a reshape only settles
                self.engine.abandon(self._ahead)
            self._ahead = None
        with contextlib.suppress(Exception):  # rows may be mid-cycle: they leave regardless
            ended = Signal(event=lc.FINISH.event, reason=reason)
            self._apply_signals(Operation.finish, {uid: ended for uid in uids})
        self._filter([])
        return uids

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
            check_prompt(self.model, list(prompt), f"sequence {uid}'s prompt")  # InvalidPrompt
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
        self._drop_cycle_ahead()
        caches = self.extract_cache(wanted) if return_prompt_caches else {}
        self._queue = deque(r for r in self._queue if r.uid not in wanted)
        leaving = [uid for uid in self.batch.uids if uid in wanted]
        if leaving:
            removed = Signal(event=lc.FINISH.event, reason="removed")
            self._apply_signals(Operation.finish, {uid: removed for uid in leaving})
            self._filter([i for i, uid in enumerate(self.batch.uids) if uid not in wanted])
        return caches

    def extract_cache(self, uids: Any) -> dict[int, tuple[list[Any], list[int]]]:
        out = {}
        for r in self._queue:
            if r.uid in uids:
                out[r.uid] = self._queued_cache(r)
        self._drop_cycle_ahead()  # its rollback is not settled: the caches are read after it
        ahead = self._ahead is not None  # a plain step running ahead already fed each row's y
        for i, row in enumerate(self.batch):
            if row.uid in uids:
                tokens = list(row.payload.context) + ([row.payload.y] if ahead else [])
                out[row.uid] = ([c.extract(i) for c in self.cache], tokens)
        return out

    def next(self) -> tuple[list[PromptProcessingBatch.Response], list[MTPResponse]]:
        with mx.stream(self._stream):
            stepped = self.batch.uids
            self._events, self._emitted, self._joined, self._left = {}, {}, [], []
            self._retired_counters = {}  # counters of rows leaving in this call, for the report
            generation: list[MTPResponse] = []
            if len(self.batch):
                tic = time.perf_counter()
                size = len(self.batch)
                draining = self.controller is not None and self._draining()
                budget = self._longest_budget() if draining else 0  # only a controller reads it
                generation = self._step()
                # the live policy sees each step's period (a plain step runs between calls)
                end = time.perf_counter()
                seconds = None if self._last_step_end is None else end - self._last_step_end
                self._last_step_end = end
                left = self._longest_budget() if draining else None  # no end in sight while refilled
                worth = size * (budget - left) if left is not None else len(generation)
                self._apply_policy(size, seconds, worth, exclude=self._admitted_since, remaining=left)
                self._admitted_since = False
                self._counters.decode_time += time.perf_counter() - tic
                self._counters.generation_tokens += len(generation)
                self._counters.generation_steps += 1
            self._check_ahead()
            prompt_responses = self._prefill_segments()
            prompt_responses += self._admit(generation)
            if prompt_responses and self.engine.clock is not None:
                self.engine.clock.interrupt()  # a prefill ran: not bookkeeping of the cycle
            if self._joined:
                self._admitted_since = True  # the next period includes this prefill
            self._launch_next()
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
            self._drain_failures((prompt_responses, generation))
            return prompt_responses, generation

    def _draining(self) -> bool:
        """Is this step judged by the batch's progress to its end (`objective`)?"""
        if self.objective == "auto":
            return not self._queue
        return self.objective == "drain"

    def _longest_budget(self) -> int:
        """Tokens the batch's longest row may still generate (0 once every row has left)."""
        return max((row.payload.max_tokens - row.payload.num_generated for row in self.batch.rows), default=0)

    def _record(self, uid: Any, signal: Signal) -> None:
        self._events.setdefault(uid, []).append(signal)

    def _counters_of(self, uid: Any) -> Any:
        """A snapshot of the row's counters: a report is plain data, not a live view."""
        counters = self.batch.row(uid).counters if uid in self.batch else self._retired_counters.get(uid)
        return counters.copy() if counters is not None else None

    def _launch_next(self) -> None:
        """Start the next step now, as mlx-lm's generator does for its plain steps.

        The device computes it while the caller handles this call's responses; the next
        `next()` syncs it. Not while a queued request has a free row to join (admission
        reshapes the batch first); a queue waiting for a row does not stop it, as it does
        not stop mlx-lm's. `remove`, `extract_cache` and `close` undo a cycle launched this way.
        """
        if not len(self.batch) or self._admission_due() or self._ahead is not None:
            return
        self._reconcile()  # nothing runs ahead now: a resume put off for a plain step applies
        rows = self.batch.rows
        plans = self._plans(rows, [row.payload for row in rows])
        if any(p.k for p in plans) and not self.run_ahead:
            return  # a cycle waits for the next call (measured no gain on a CPU: BENCHMARKS.md)
        step = self._launch(rows, plans)
        if step is not None:
            self._keep_ahead(step)

    def _admission_due(self) -> bool:
        """A queued request has a free row to join at the end of this call."""
        return bool(self._queue) and len(self.batch) < self.completion_batch_size

    def _launch_ahead(self, rows: tuple[Row, ...], plans: list[RowPlan]) -> None:
        """Launch step n + 1 before step n settles. A fault while building it is recorded
        once step n's events are (`_fault_ahead`): the lifecycle sees steps in order."""
        try:
            uids = [row.uid for row in rows]
            launch = self.engine.launch if any(p.k for p in plans) else self.engine.plain
            step = launch(plans, uids)
        except SpeculativeFault as fault:
            self._ahead_fault = (fault, [(row.uid, p.k) for row, p in zip(rows, plans) if p.k > 0])
            return
        self._keep_ahead(step)

    def _keep_ahead(self, step: Flight | PlainStep) -> None:
        if isinstance(step, PlainStep):
            mx.async_eval(step.tokens)
        self._ahead = step

    def _fault_ahead(self) -> None:
        """Record a fault met while launching a step ahead, for the rows still here."""
        if self._ahead_fault is None:
            return
        fault, rows = self._ahead_fault
        self._ahead_fault = None
        here = [(uid, k) for uid, k in rows if uid in self.batch]
        if here:
            self._fault_rows([uid for uid, _ in here], [k for _, k in here], fault)

    def _check_ahead(self) -> None:
        """Keep the step launched ahead only if it still fits: the same rows, every row
        speculating or not as the lifecycle and the policy now say (a suspended row never
        drafts) and none deeper than now allowed. Otherwise it is undone and the step is
        launched again when due."""
        step = self._ahead
        if step is None:
            return
        rows = self.batch.rows
        fresh = self._plans(rows, [row.payload for row in rows]) if rows else []
        same_rows = [row.uid for row in rows] == step.uids
        resuming = [self._resuming(row) for row in rows]  # their plain step is kept (`_reconcile`)
        if same_rows and step_rules.ahead_fits([p.k for p in step.plans], [p.k for p in fresh], resuming):
            return
        self.engine.abandon(step)
        self._ahead = None
        self._reconcile()  # a resume put off for the step just undone applies now

    def _drop_cycle_ahead(self) -> None:
        if isinstance(self._ahead, Flight):
            self.engine.abandon(self._ahead)
            self._ahead = None

    def _apply_policy(
        self,
        size: int,
        seconds: float | None,
        tokens: int,
        exclude: bool = False,
        remaining: int | None = None,
    ) -> None:
        """Feed the controller this step's outcomes and wall time; its action becomes events.
        remaining: the longest budget left in a draining batch (None: rows are refilled)."""
        if self.controller is None:
            return
        step_rules.feed(
            self.controller,
            size,
            self._events.values(),
            seconds=seconds,
            tokens=tokens,
            remaining=remaining,
            exclude=exclude,
        )
        self._reconcile()

    def _reconcile(self, rows: Any = None) -> None:
        """Bring the rows' lifecycle in line with the controller's verdict: suspend or resume.

        The verdict, not the returned action, is the truth: a window the controller calls
        plain is a suspended window for every row that could speculate.
        """
        if self.controller is None:
            return
        rows = self.batch.rows if rows is None else rows
        # a plain step launched ahead belongs to the suspended window it was launched in: its
        # rows settle it as a plain step and resume after it (their next step is planned as
        # a cycle meanwhile), so the switch undoes nothing
        ahead = set(self._ahead.uids) if isinstance(self._ahead, PlainStep) else set()
        signal, picked = step_rules.steer(
            self.controller, [r.state for r in rows], [r.uid in ahead for r in rows]
        )
        if picked:
            self._apply_signals(Operation(signal.event.value), {rows[i].uid: signal for i in picked})

    def _resuming(self, row: Row) -> bool:
        """A suspended row the controller speculates for again: it resumes at the next
        `_reconcile` with no plain step of it running ahead."""
        speculating = self.controller is not None and self.controller.speculating
        return speculating and row.state is State.suspended  # the state says it: no refusal string check

    def next_generated(self) -> list[MTPResponse]:
        while True:
            prompt_responses, generation = self.next()
            if not generation and prompt_responses:
                continue
            return generation

    # -- admission -------------------------------------------------------------------
    def _admit(self, out: list[MTPResponse]) -> list[PromptProcessingBatch.Response]:
        if self._ahead is not None:
            # a step runs ahead for the rows as they were (a row left on a stop token while
            # it was built): it cannot be undone across that reshape, so rows join next call
            return []
        ready = self._pop_ready(min(self.prefill_batch_size, self.completion_batch_size - len(self.batch)))
        joining = Batch()
        caches, head_caches, heads, ys, responses = [], [], [], [], []
        tic = time.perf_counter()
        for request, prepared in self._prepare(ready):
            row = prepared.state
            self._first_logprobs[request.uid] = prepared.first_logprobs
            joining.extend([request.uid], payloads=[row])
            resolution = (
                lc.ADMIT if row.refusal is None else Signal(event=lc.REFUSE.event, reason=row.refusal)
            )
            self._apply_signals(Operation.resolve, {request.uid: resolution}, joining)
            self._joined.append(request.uid)
            caches.append(prepared.cache)
            head_caches.append(prepared.head_cache)
            heads.append(prepared.head)
            ys.append(row.y)
            self._counters.prompt_tokens += len(request.prompt)
            total = len(request.all_tokens) + len(request.prompt)
            responses.append(PromptProcessingBatch.Response(request.uid, (total, total), True, True))
        self._counters.prompt_time += time.perf_counter() - tic
        if not ys:
            return responses
        engine = self.engine
        engine.cache = _extend_cache(engine.cache, ragged_kv.adopt(_merge_caches(caches)))
        if self.head is not None:
            engine.head_cache = _extend_cache(engine.head_cache, ragged_kv.adopt(_merge_caches(head_caches)))
        engine.extend(mx.array(ys, dtype=mx.uint32), heads)
        first = len(self.batch)
        self.batch.extend(joining)
        self._reconcile(self.batch.rows[first:])  # joining rows follow the batch-wide verdict
        # The first token of each joining row came from its prefill: emit it now (counted as
        # generated, as mlx-lm's generator counts it).
        self._counters.generation_tokens += len(self.batch) - first
        finished = []
        for row in self.batch.rows[first:]:
            state: RowState = row.payload
            reason = self._emit(row.uid, state, state.y, self._first_logprobs.pop(row.uid), False, out)
            if reason:
                finished.append(row.uid)
        if finished:
            self._finish(finished, out)
        return responses

    def _prepare(self, ready: list[InsertRequest]) -> list[tuple[InsertRequest, PreparedRow]]:
        """Prefill the joining requests, in order: those with nothing cached together in
        groups of similar length (`join_groups`; all in one group where caches are
        windowed, as mlx-lm joins them), the rest alone. A request whose prefill
        raises fails alone (melix_mlx.batch_surface): if a joint prefill raises, the
        group's rows not yet ready are prefilled one by one (the same tokens either way),
        so only the one that fails on its own leaves, and a row made ready before the
        failure keeps its first token (its sampler is not run twice)."""
        options: dict[str, Any] = dict(
            refusal=self.refusal,
            head_disabled=getattr(self.controller, "disabled", False),
            max_kv_size=self.max_kv_size,
            prefill_step_size=self.prefill_step_size,
        )
        done: dict[int, PreparedRow] = {}
        for group in join_groups([r for r in ready if joins_fresh(r)], self._max_padding):
            if len(group) > 1:
                with contextlib.suppress(Exception):
                    prepared = prepare_rows(self.model, self.head, self.engine, group, **options)
                    for request, row in zip(group, prepared):
                        done[request.uid] = row
        out = []
        for request in ready:
            if request.uid not in done:
                try:
                    done[request.uid] = prepare_row(self.model, self.head, self.engine, request, **options)
                except Exception as exc:  # that request only
                    self._fail(request, exc)
                    continue
            out.append((request, done[request.uid]))
        return out

    # -- one decode step -------------------------------------------------------------
    def _plans(
        self, rows: tuple[Row, ...], states: list[RowState], before: list[RowPlan] | None = None
    ) -> list[RowPlan]:
        """Each row's plan for the next step; `before`: the plans of a step not yet settled
        (each row may still emit k + 1 tokens in it)."""
        depth = getattr(self.controller, "k", None) if self.controller is not None else None
        plans = []
        for i, (row, state) in enumerate(zip(rows, states)):
            k, remaining = 0, None
            ready = row.state in lc.CYCLE_READY or self._resuming(row)
            if ready and self.head is not None:  # a refused or faulted row is never cycle-ready
                remaining = state.max_tokens - state.num_generated
                if before is not None:  # the fewest that can remain after the step in flight
                    remaining -= before[i].k + 1
                k = step_rules.cycle_depth(min(depth or state.k, state.k), remaining)
            sampler = None if state.sampler is greedy_sampler else state.sampler
            history = state.history.upto() if state.history is not None else None
            # `remaining` caps the drafts a row ending in this cycle keeps (RowPlan.keep)
            plans.append(RowPlan(k, state.params, sampler, state.processors, history, remaining))
        return plans

    def _step(self) -> list[MTPResponse]:
        rows = self.batch.rows
        states: list[RowState] = [row.payload for row in rows]
        step = self._ahead  # launched at the end of the previous call?
        plans = step.plans if step is not None else []
        self._ahead = None
        if step is None:
            self._reconcile()  # nothing runs ahead now: a resume put off for a plain step applies
            plans = self._plans(rows, states)
            step = self._launch(rows, plans)
            if step is None:
                return []
        following = self._plans_ahead(states, plans)
        if following is not None:  # step n + 1 is built before step n is synced
            self._launch_ahead(rows, following)
        if isinstance(step, Flight):
            try:
                settled = self.engine.settle(step)
            except SpeculativeFault as fault:  # the rows continue plainly; no token was emitted
                self._ahead = None  # undoing the cycle voided the step built on it
                spec = [i for i, p in enumerate(plans) if p.k > 0]
                self._fault_rows([rows[i].uid for i in spec], [plans[i].k for i in spec], fault)
                return []
        else:
            B = len(rows)
            tokens = self.engine.settle_plain(step)
            settled = Settled([0] * B, [[t] for t in tokens], step.logprobs[:, None], [[]] * B, [0] * B)
        self.row_forwards += len(rows)
        out = self._conclude(rows, states, plans, settled)
        self._fault_ahead()
        return out

    def _launch(self, rows: tuple[Row, ...], plans: list[RowPlan]) -> Flight | PlainStep | None:
        """Launch this step; None when its cycle faulted while building (rows faulted)."""
        uids = [row.uid for row in rows]
        if not any(p.k for p in plans):
            return self.engine.plain(plans, uids)
        try:
            return self.engine.launch(plans, uids)
        except SpeculativeFault as fault:  # the rows continue plainly; no token was emitted
            spec = [i for i, p in enumerate(plans) if p.k > 0]
            self._fault_rows([rows[i].uid for i in spec], [plans[i].k for i in spec], fault)
            return None

    def _plans_ahead(self, states: list[RowState], plans: list[RowPlan]) -> list[RowPlan] | None:
        """The plans of step n + 1 if it may be launched before step n settles, else None.

        Not while a queued request has a free row (admission reshapes the batch), not when a
        row may reach its length limit in step n (it leaves), not with logits processors
        (they read the host's history). A row that leaves on a stop token in step n frees
        its row for the queue one call later (`_admit`). Without `run_ahead` only a plain
        step after a plain step (mlx-lm's own pipelining); with it, anything after a plain
        step, and after a cycle where rollback runs in the graph, but no cycle while step
        n's update may turn speculation off on schedule (`LiveController.plain_due`)."""
        if self._admission_due() or any(p.processors for p in plans):
            return None
        if any(s.max_tokens - s.num_generated <= p.k + 1 for s, p in zip(states, plans)):
            return None
        cycle = any(p.k for p in plans)
        if not step_rules.may_build_on(cycle, self.run_ahead, self.engine):
            return None  # checked before the plans are built: every CPU cycle passes here
        following = self._plans(self.batch.rows, states, before=plans)
        cycle_ahead = any(p.k for p in following)
        if cycle_ahead and not step_rules.may_launch_cycle_ahead(self.run_ahead, self.controller):
            return None  # a cycle the schedule's switch to plain would undo, or no run-ahead
        return following

    def _conclude(
        self, rows: tuple[Row, ...], states: list[RowState], plans: list[RowPlan], settled: Settled
    ) -> list[MTPResponse]:
        """Lifecycle events for the step (one atomic batch step), then emission."""
        self._apply_signals(
            Operation.step,
            {row.uid: step_rules.step_signals(plans[i].k, settled.accepted[i]) for i, row in enumerate(rows)},
        )
        out: list[MTPResponse] = []
        finished = []
        for i, row in enumerate(rows):
            state = states[i]
            tokens = settled.tokens[i]
            a, kept = settled.accepted[i], settled.kept[i]
            state.context.extend([state.y, *tokens[:kept]])  # what the row's caches now hold
            if state.history is not None:
                state.history.extend([state.y, *tokens[:kept]])
            state.y = tokens[-1]
            for j, token in enumerate(tokens):
                if self._emit(row.uid, state, token, settled.logprobs[i, j], j < a, out):
                    finished.append(row.uid)
                    break
        if finished:
            self._finish(finished, out)
        return out

    def _apply_signals(
        self, operation: Operation, signals: dict[Any, Signal | list[Signal]], batch: Batch | None = None
    ) -> None:
        """The one funnel for every lifecycle event: the batch operation (atomic, and only
        the events spec/batch.toml lists for it), then the report."""
        (self.batch if batch is None else batch).apply(operation, signals)
        for uid, sent in signals.items():
            for signal in [sent] if isinstance(sent, Signal) else sent:
                self._record(uid, signal)

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

    def _fault_rows(self, uids: list[Any], ks: list[int], fault: SpeculativeFault) -> None:
        message = str(fault)
        outcome = {uid: step_rules.fault_signals(k, fault.drafted, message) for uid, k in zip(uids, ks)}
        recorded = {uid: before for uid, (before, _) in outcome.items() if before}
        if recorded:  # the drafts existed: record them, then discard them with the fault
            self._apply_signals(Operation.step, recorded)
        self._apply_signals(Operation.fault, {uid: signal for uid, (_, signal) in outcome.items()})
        faulted = set(uids)
        for uid in uids:
            self.batch.row(uid).payload.fault = message
        for row, head in zip(self.batch.rows, self.engine.rows):
            if row.uid in faulted:  # faulted for good: the head does no more work for it
                self.engine.forget(head)

    def _finish(self, uids: list[Any], out: list[MTPResponse]) -> None:
        self._drop_cycle_ahead()  # built for rows that are leaving; their caches are read now
        done = set(uids)
        by_uid = {}
        for i, row in enumerate(self.batch):
            if row.uid in done:
                by_uid[row.uid] = ([c.extract(i) for c in self.cache], list(row.payload.context))
        self._apply_signals(Operation.finish, {uid: lc.FINISH for uid in uids})
        for uid in uids:
            self._retired_counters[uid] = self.batch.row(uid).counters
        self._left.extend(uids)
        for response in out:
            if response.uid in done and response.finish_reason is not None:
                response.prompt_cache, response.all_tokens = by_uid[response.uid]
                row = self.batch.row(response.uid)
                response.stats = row.counters.summary() | {
                    "state": row.state.value,
                    "refusal": row.payload.refusal,
                    "refusal_reason": reason_of(row.payload.refusal),
                    "fault": row.payload.fault,
                }
        self._filter([i for i, uid in enumerate(self.batch.uids) if uid not in done])

    def _filter(self, keep: list[int]) -> None:
        self._drop_cycle_ahead()  # built for rows that are leaving
        engine = self.engine
        if keep:
            for c in engine.cache:
                c.filter(keep)
            for c in engine.head_cache:
                c.filter(keep)
        else:
            engine.cache, engine.head_cache = [], []
        engine.filter(keep)  # a plain step running ahead keeps the surviving rows
        if self._ahead is not None:  # the narrowed step carries the kept rows' plans and uids
            self._ahead = engine.in_flight[0] if keep else None
        self.batch.filter(keep)
