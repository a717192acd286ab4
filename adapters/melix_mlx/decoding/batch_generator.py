"""Batched MTP: a drop-in for mlx-lm's `BatchGenerator` where every row drafts and verifies.
This module is its generation half: each `next()` runs one step of the step pipeline
(melix_mlx.decoding.step_driver, the same one the single-sequence decoder drives) over the rows
and emits its tokens. Admission lives in batch_admission.py (prompt processing in
batch_prompts.py), the server-facing surface in batch_surface.py, row records in
batch_rows.py, the cycle itself in engine.py. (Over 400 lines: one step's plan, signals,
emission, finish and filter read together, as the pipeline calls them.)

Rules of this module:
- Same surface as `mlx_lm.generate.BatchGenerator` (0.32): `insert`, `insert_segments`,
  `remove`, `next`, `next_generated`, `stats`, `close`, `extract_cache`,
  `prompt_cache_nbytes` (the server-facing parts live in melix_mlx.decoding.batch_surface).
  One `next()` may return several responses for the same uid (every token a verify
  accepted, in order); each response carries `from_draft`, and a finishing response
  carries the row's speculative stats.
- Row i of `self.batch` (a melix_fsm Batch) is row i of the main cache and of the head
  cache. Joining rows are prefilled (together where nothing of them is cached yet, as
  mlx-lm prefills its prompts; this also primes their head caches from the prompts) and
  appended with `extend`; leaving rows go with one `filter`. A row's
  speculative state (pending head pairs, draft count, sampler, counters, lifecycle
  machine) lives in its Batch row and travels through both reshapes untouched.
- One step is one cycle of melix_mlx.runtime.engine, planned, launched (ahead where it may be),
  settled and steered by melix_mlx.decoding.step_driver.StepPipeline, as for one sequence:
  k - 1 chained head forwards, one batched verify with acceptance on the device,
  one head catch-up that also drafts the next cycle, one host sync, per-row rollback
  with no replay. Rows that do not speculate (refused, suspended, faulted) ride in the
  same verify as plain decode (their draft slots are padding, rolled back); when no row
  speculates the step is a plain [B, 1] forward.
- Rollback is per row (melix_mlx.runtime.rollback, melix_mlx.runtime.capture): no row's rollback touches
  another row.
- Lifecycle: every admit/refuse, draft, verify, verified, plain step, suspend/resume,
  fault and finish is applied to the Batch; `last_report` (melix_fsm.report.StepReport)
  holds what each row went through in the latest `next()`: the event-reporting contract
  the conformance kit checks.
- Settings: `num_draft_tokens` (an int or "auto") and `device_policy` ("auto",
  "force_on", "force_off") resolve as `melix-fsm serve` resolves its flags
  (melix_mlx.decoding.startup.activate: the same batched receipt, in `self.receipt`, the
  calibration at batch size 1 reused from the calibration cache, the live controller).
  Left out: what `load_with_heads` was given, else depth 1 and no policy. A finishing
  response's `stats` is a typed melix_fsm.stats.GenerationStats.
- Device policy: an optional `LiveController` (melix_fsm.policy.controller) is fed every
  step's batch size, verify outcomes and seconds; its verdict becomes suspend / resume
  lifecycle events for every row at a cycle boundary. Without one, speculation stays on.
  What a step is worth (`objective`): every emitted token, priced at a plain step's cost
  per token. "throughput" prices it at the step's own batch size, right while requests
  wait for rows (a finished row is refilled at once); "drain" at the size the batch
  drained from: a batch nobody refills ends with its longest row, plain would run all of
  them to the end together, so a speculating batch whose rows drift apart pays a tail of
  small-batch steps that emit few tokens each, and those steps score low. "auto" (the
  default) is drain while no request waits, throughput otherwise; a server, which expects
  arrivals, passes "throughput". A draining step also passes the longest budget left as
  `remaining`, so the controller runs no probe the batch's end leaves no room to pay for.
- Faults: an exception in the head or verify forward faults the rows that were
  speculating; caches are restored and they continue as plain decode. No token is lost.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import PromptProcessingBatch, StopSequences
from mlx_lm.generate_utils import BatchCounters
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from melix_fsm import lifecycle as lc
from melix_fsm.batch import Batch, Operation, Row
from melix_fsm.lifecycle import Signal, State
from melix_fsm.policy.controller import LiveController
from melix_fsm.reasons import RefusalReason, reason_of, refusal_text
from melix_fsm.receipt import ServingContext
from melix_fsm.report import RowReport, StepReport
from melix_fsm.stats import GenerationStats

from ..loading import head_receipt
from ..loading.errors import check_batch_form
from ..runtime import rollback
from ..runtime.engine import CycleEngine
from ..runtime.engine_records import RowPlan, Settled
from . import step_rules
from .batch_admission import BatchAdmission
from .batch_prompts import MAX_PADDING
from .batch_rows import InsertRequest, MTPResponse, RowState
from .batch_surface import BatchSurface, RequestFailed
from .startup import activate
from .step_driver import StepPipeline, run_ahead_default

__all__ = ["OBJECTIVES", "InsertRequest", "MTPBatchGenerator", "MTPResponse", "RequestFailed", "RowState"]

OBJECTIVES = ("auto", "throughput", "drain")  # what a step is worth to the live policy


class MTPBatchGenerator(BatchAdmission, BatchSurface):
    """Continuous batching with MTP speculation in every row; see the module rules."""

    def __init__(
        self,
        model: nn.Module,
        head: nn.Module | None,
        *,
        num_draft_tokens: int | Literal["auto"] | None = None,
        device_policy: Literal["auto", "force_on", "force_off"] | None = None,
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
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if kv_bits is not None:  # typed, from the registry: mlx-lm cannot merge quantized caches
            from ..loading.errors import batched_quantized_kv

            raise batched_quantized_kv()
        # every row shares batch caches: a batched receipt, calibrated at one row as the server does
        run = activate(
            model,
            head,
            num_draft_tokens,
            device_policy,
            controller=controller,
            serving=ServingContext(batched=True),
        )
        controller, self.receipt = run.controller, run.receipt  # the receipt: None without one
        refusal = refusal or run.refusal
        self.model = model
        self.head = head
        self.num_draft_tokens = run.k
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
        check_batch_form(fresh_cache, rollback.kind_of)  # mlx-lm merges rows with `merge`
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
        self.objective = objective
        # build step n + 1 before step n syncs (melix_mlx.decoding.step_driver.run_ahead_default: on a GPU)
        run_ahead = run_ahead_default() if run_ahead is None else run_ahead
        self.steps = StepPipeline(self.engine, self, controller, run_ahead)
        self.last_report = StepReport()
        self._events: dict[Any, list[Signal]] = {}
        self._emitted: dict[Any, list[int]] = {}
        self._joined: list[Any] = []
        self._left: list[Any] = []
        self._admitted_since = False
        self._drain_from: int | None = None  # the batch size a drain started from
        self._retired_counters: dict[Any, Any] = {}
        self._init_surface()

    @property
    def controller(self) -> LiveController | None:
        return self.steps.controller

    @property
    def run_ahead(self) -> bool:
        return self.steps.run_ahead

    @run_ahead.setter
    def run_ahead(self, value: bool) -> None:
        self.steps.run_ahead = value

    def remove(self, uids: Sequence[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        wanted = set(uids)
        self.steps.drop_cycle_ahead()
        caches = self.extract_cache(wanted) if return_prompt_caches else {}
        self._queue = deque(r for r in self._queue if r.uid not in wanted)
        leaving = [uid for uid in self.batch.uids if uid in wanted]
        if leaving:
            removed = Signal(event=lc.FINISH.event, reason="removed")
            self._apply_signals(Operation.finish, {uid: removed for uid in leaving})
            self._filter([i for i, uid in enumerate(self.batch.uids) if uid not in wanted])
        return caches

    def next(self) -> tuple[list[PromptProcessingBatch.Response], list[MTPResponse]]:
        with mx.stream(self._stream):
            stepped = self.batch.uids
            self._events, self._emitted, self._joined, self._left = {}, {}, [], []
            self._retired_counters = {}  # counters of rows leaving in this call, for the report
            generation = self._generate() if len(self.batch) else []
            self.steps.check_ahead()
            prompt_responses = self._prefill_segments()
            prompt_responses += self._admit(generation)
            if prompt_responses and self.engine.clock is not None:
                self.engine.clock.interrupt()  # a prefill ran: not bookkeeping of the cycle
            if self._joined:
                self._admitted_since = True  # the next period includes this prefill
            if len(self.batch) and not self._admission_due():
                # the device computes the next step while the caller handles these responses;
                # a cycle waits for the next call without run-ahead (no gain on a CPU: BENCHMARKS.md)
                self.steps.launch_next(cycle_waits=not self.run_ahead)
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

    def _generate(self) -> list[MTPResponse]:
        """One step of the rows, its tokens emitted, the live policy fed its period and worth."""
        tic = time.perf_counter()
        size = len(self.batch)
        draining = self.controller is not None and self._draining()
        # a drain's tokens are priced at the batch it started from, or last took rows at (`objective`)
        fresh = self._drain_from is None or self._admitted_since
        self._drain_from = (size if fresh else self._drain_from) if draining else None
        generation = self._step()
        # the live policy sees each step's period (a plain step runs between calls)
        seconds = self.steps.step_seconds()
        left = self._longest_budget() if draining else None  # no end in sight while refilled
        events = self._events.values()  # every row's events of this call (the step's verify outcome)
        exclude, self._admitted_since = self._admitted_since, False  # a prefill ran in the period
        worth = {"tokens": len(generation), "priced_at": self._drain_from}
        self.steps.feed(size, events, seconds=seconds, remaining=left, exclude=exclude, **worth)
        self._counters.decode_time += time.perf_counter() - tic
        self._counters.generation_tokens += len(generation)
        self._counters.generation_steps += 1
        return generation

    def next_generated(self) -> list[MTPResponse]:
        while True:
            prompt_responses, generation = self.next()
            if not generation and prompt_responses:
                continue
            return generation

    def _draining(self) -> bool:
        """Is this step judged by the batch's progress to its end (`objective`)?"""
        if self.objective == "auto":
            return not self._queue
        return self.objective == "drain"

    def _longest_budget(self) -> int:
        """Tokens the batch's longest row may still generate (0 once every row has left)."""
        return max((row.payload.max_tokens - row.payload.num_generated for row in self.batch.rows), default=0)

    def _counters_of(self, uid: Any) -> Any:
        """A snapshot of the row's counters: a report is plain data, not a live view."""
        counters = self.batch.row(uid).counters if uid in self.batch else self._retired_counters.get(uid)
        return counters.copy() if counters is not None else None

    def _admission_due(self) -> bool:
        """A queued request has a free row to join at the end of this call."""
        return bool(self._queue) and len(self.batch) < self.completion_batch_size

    # -- the rows, as the step pipeline's client (melix_mlx.decoding.step_driver.StepRows) ------
    def step_uids(self) -> list[Any]:
        return list(self.batch.uids)

    def step_states(self) -> list[State]:
        return [row.state for row in self.batch.rows]

    def plan_step(self, before: list[RowPlan] | None) -> list[RowPlan]:
        """Each row's plan for the next step; `before`: the plans of a step not yet settled
        (each row may still emit k + 1 tokens in it)."""
        controller = self.controller
        depth = getattr(controller, "k", None) if controller is not None else None
        plans = []
        for i, row in enumerate(self.batch.rows):
            state: RowState = row.payload
            k, remaining = 0, None
            ready = row.state in lc.CYCLE_READY or self.steps.resuming(row.state)
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

    def may_plan_ahead(self, plans: list[RowPlan]) -> bool:
        """Not while a queued request has a free row (admission reshapes the batch), not
        when a row may reach its length limit in the step (it leaves), not with logits
        processors (they read the host's history). A row that leaves on a stop token
        frees its row for the queue one call later (batch_admission)."""
        if self._admission_due() or any(p.processors for p in plans):
            return False
        states = [row.payload for row in self.batch.rows]
        return all(s.max_tokens - s.num_generated > p.k + 1 for s, p in zip(states, plans))

    def apply_signals(self, operation: Operation, signals: dict[Any, Signal | list[Signal]]) -> None:
        """The step pipeline's events; a fault's message is kept with the row (stats)."""
        self._apply_signals(operation, signals)
        if operation is Operation.fault:
            for uid, signal in signals.items():
                if isinstance(signal, Signal):
                    self.batch.row(uid).payload.fault = signal.reason

    # -- one decode step -------------------------------------------------------------
    def _step(self) -> list[MTPResponse]:
        rows = self.batch.rows
        outcome = self.steps.step()
        if outcome is None:  # a cycle faulted: its rows continue plainly; no token was emitted
            return []
        self.row_forwards += len(rows)
        out = self._conclude(rows, [row.payload for row in rows], outcome.plans, outcome.settled)
        self.steps.record_ahead_fault()
        return out

    def _conclude(
        self, rows: tuple[Row, ...], states: list[RowState], plans: list[RowPlan], settled: Settled
    ) -> list[MTPResponse]:
        """Emission of a settled step (its lifecycle events are sent): each row's tokens,
        up to its finish."""
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
            self._events.setdefault(uid, []).extend([sent] if isinstance(sent, Signal) else sent)

    # -- emission, reshaping ---------------------------------------------------------
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

    def _finish(self, uids: list[Any], out: list[MTPResponse]) -> None:
        self.steps.drop_cycle_ahead()  # built for rows that are leaving; their caches are read now
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
                response.stats = GenerationStats.of(
                    row.counters.summary()
                    | {
                        "state": row.state.value,
                        "refusal": row.payload.refusal,
                        "refusal_reason": reason_of(row.payload.refusal),
                        "fault": row.payload.fault,
                    }
                )
        self._filter([i for i, uid in enumerate(self.batch.uids) if uid not in done])

    def _filter(self, keep: list[int]) -> None:
        self.steps.drop_cycle_ahead()  # built for rows that are leaving
        engine = self.engine
        if keep:
            for c in engine.cache:
                c.filter(keep)
            for c in engine.head_cache:
                c.filter(keep)
        else:
            engine.cache, engine.head_cache = [], []
        self.steps.filter(keep)  # a plain step running ahead keeps the surviving rows
        self.batch.filter(keep)
