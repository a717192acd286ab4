"""The speculative cycle engine: draft -> verify -> accept -> rollback, for B rows at once.

Single-sequence decoding (melix_mlx.decode) runs it with B = 1 on mlx-lm's own cache;
the batched generator (melix_mlx.batch_generator) on merged batch caches. Both drive
it through one step pipeline (melix_mlx.decoding.step_driver): there is one acceptance rule, one
head catch-up, one rollback.
(Over 400 lines on purpose: the one graph a cycle builds, the in-flight steps and the
rollback that undoes them read together; the head's side (engine_head.py), acceptance
(acceptance.py), logits processing (logits_processing.py), timing and rollback mechanics
live in their own modules, and the step pipeline that drives it in step_driver.py.)

Rules of this module:
- One lazy graph and ONE host sync per cycle. `launch` builds: the chained drafts
  2..k on the head, the batched verify forward, the acceptance test on the device
  (greedy: argmax compare; sampled: the rejection test with uniforms drawn on the
  device, one per position, residual resampling and the bonus token), the head's
  catch-up over the verified block and the NEXT cycle's first draft. `settle` makes
  the one sync, reads accept lengths and tokens, and trims the caches.
- Head-slot convention: pair j joins the main model's post-norm hidden h_j with token
  t_{j+1} and predicts t_{j+2}. The catch-up feeds all k + 1 verified positions with
  fixed shape (tokens after a row's accepted prefix are don't-care); the next draft is
  read at position a (the row's accept count), which causal attention keeps blind to
  the don't-care positions; `settle` then trims those positions. So the head never
  needs a separate catch-up forward and shapes never depend on acceptance.
- Run-ahead: a launched cycle already holds the engine's next state (last token, each
  row's next draft, the caches as rolled back, all lazy), so the NEXT step can be
  launched before this one is settled, as mlx-lm's generate_step builds token n+1
  before it reads token n. That needs a rollback that runs in the graph
  (`rollback.in_graph`: ragged batch KV and captured recurrent state); with other caches
  the trims wait for the sync and `may_run_ahead` says no. Flights settle in launch
  order; undoing one (a fault, an abandoned step) voids every step launched after it.
- Rollback without replay: KV layers are trimmed per row (melix_mlx.runtime.rollback); recurrent
  layers are set to the state captured inside the verify at each row's accepted length
  (melix_mlx.runtime.capture). A cache whose recurrent layers cannot be captured is refused by
  the decoders before a cycle runs (`rollback.unsupported_kinds`); were one launched
  anyway, the cycle faults (caches restored) instead of rolling back inexactly.
- The verify runs each family's decode-shaped layers where mlx-lm's multi-token form is
  a prefill form (melix_mlx.runtime.absorbed_mla: latent attention absorbed, not expanded over
  the whole context). Those layer variants are installed with the engine and inert
  outside a verify.
- A row that ends within a cycle (`RowPlan.remaining` tokens left) keeps at most
  `RowPlan.keep` = remaining - 1 drafts: an
  accepted draft past that is the target's own token there and becomes its last token,
  so caches hold nothing past it (mlx-lm's hand-back: every token but the last).
  `accepted` counts the accepted drafts the row emits (the one past the cap included);
  `kept` is what the caches hold.
- Rows with k = 0 ride along in a speculating batch as plain decode: their draft slots
  are padding, their accept count is forced to 0. When no row speculates, `plain`
  runs a plain [B, 1] forward instead; the hiddens wait as pending head pairs until
  speculation resumes (`catch_up`), flushed every `PENDING_FLUSH` steps.
- Faults: an exception while building or evaluating a speculative cycle restores every
  cache to the cycle's start and is re-raised as `SpeculativeFault`; the caller decides
  what the rows do next. No token was emitted by a failed cycle. An exception from the
  caller's own sampler or logits processor is not a fault: the caches are restored and
  it propagates unchanged, as it would from mlx-lm.
- Under mx.distributed (a model sharded by melix_mlx.runtime.distributed) every token-valued
  result (drafts, accept counts, bonus and plain tokens) is rank 0's, agreed inside the
  graph, so every rank feeds the same shapes and tokens to its next collective. A fault
  there is not absorbed per rank (the ranks would part ways): it is raised as a typed
  `RankFailed` (`PeerLost` when another rank went away) and ends the run on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from melix_fsm.pipeline import PIPELINE, PipelineEvent, PipelineTracker

from . import absorbed_mla, capture, prompt_score, rollback
from .acceptance import accept_sampled, cap_accepted
from .cycle_clock import CycleClock
from .distributed import agreement, rank_error
from .engine_head import draw, feed_prompt, head_at, stack_pending
from .engine_records import (
    CallerError,
    EngineState,
    Flight,
    ForwardFailed,
    PlainStep,
    RowHead,
    RowPlan,
    Settled,
    SpeculativeFault,
)
from .hidden import forward_with_hidden, main_parts
from .logits_processing import call_caller, processed_logprobs
from .sampling import SamplingParams

Sampler = Callable[[mx.array], mx.array]
PENDING_FLUSH = 32  # plain steps after which pending head pairs are fed to the head


def _forward(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a model or head forward; its exceptions are speculative faults."""
    try:
        return fn(*args)
    except Exception as exc:
        raise ForwardFailed(exc) from exc


class CycleEngine:
    """Draft/verify/accept/rollback over B rows; see the module rules."""

    def __init__(self, model: nn.Module, head: nn.Module | None, cache: list[Any], head_cache: list[Any]):
        self.model = model
        self.head = head
        self.cache = cache
        self.head_cache = head_cache
        self._captured = 0  # recurrent layers that capture (counted once: a tree walk costs ms)
        if head is not None:  # verify-time layer variants; unmarked they are mlx-lm's own
            self._captured = capture.install(model)
            absorbed_mla.install(model)
            if isinstance(head, nn.Module):
                absorbed_mla.install(head)  # the head's catch-up is verify-shaped too
        self.y: mx.array = mx.zeros((0,), mx.uint32)  # [B] last token, not yet fed
        self.rows: list[RowHead] = []
        self.target_forwards = 0
        self.replay_forwards = 0  # stays 0: rollback selects captured states, it never replays
        self.head_forwards = 0
        self.abandoned_steps = 0  # launched ahead, then undone: device work thrown away
        self._drafted = False
        # launched, not yet settled, in launch order; its length is the pipeline's state
        # (spec/pipeline.toml), which every change below sends an event to
        self._in_flight: list[Flight | PlainStep] = []
        self.pipeline: PipelineTracker = PIPELINE.tracker()
        self.clock: CycleClock | None = None  # set to a CycleClock to break cycles down (bench)
        self.agreement = agreement(model)  # rank 0's tokens on every rank (None: one process)

    def agreed(self, tokens: mx.array) -> mx.array:
        """Rank 0's tokens under mx.distributed (lazy, inside the graph); else unchanged."""
        return tokens if self.agreement is None else self.agreement.tokens(tokens)

    def _fault(self, exc: BaseException, drafted: bool) -> Exception:
        if self.agreement is not None:  # one rank must not fall back to plain decoding alone
            return rank_error(exc, context="speculative cycle failed: ")
        return SpeculativeFault(exc, drafted=drafted)

    # -- rows ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def prime(
        self,
        head_cache: list[Any],
        hiddens: mx.array,
        pair_tokens: list[int],
        params: SamplingParams | None,
        step_size: int = 2048,
        score: bool = False,
    ) -> RowHead:
        """A joining row's head: feed its prompt pairs (h_i, t_{i+1}) into `head_cache`.

        In chunks of `step_size` as the prefill feeds the model (each chunk's head cache
        evaluated before the next is built), and only the last slot projected to the
        vocabulary: the row's first draft is all a prime draws. With `score`, a sampled
        row's prompt is scored too (`RowHead.prompt_acceptance`, lazy:
        melix_mlx.runtime.prompt_score).
        """
        row = RowHead()
        if self.head is None:
            return row
        sampled = score and params is not None and not params.greedy
        scored = prompt_score.SLOTS if sampled else 0
        logits, row.hidden, slots = feed_prompt(
            self.head, head_cache, hiddens, pair_tokens, step_size, scored
        )
        if slots is not None and params is not None:
            targets = main_parts(self.model).lm_head(hiddens[hiddens.shape[0] - slots.shape[0] :])
            row.prompt_acceptance = prompt_score.sampled_overlap(targets, slots, params)
        self.head_forwards += 1
        drafts, qs = self._draw(logits, [params])
        row.draft, row.q = drafts, qs[0]
        return row

    def extend(self, y: mx.array, rows: list[RowHead]) -> None:
        if self._in_flight:
            raise RuntimeError("rows cannot join while a step is in flight; settle it first")
        self.pipeline.send(PipelineEvent.extend)
        self.y = mx.concatenate([self.y, y.astype(mx.uint32)])
        self.rows.extend(rows)

    @staticmethod
    def forget(row: RowHead) -> None:
        """Drop a row's head state for good (a faulted or never-speculating row): no head work."""
        row.draft = row.q = row.hidden = None
        row.pending_h, row.pending_t = [], []

    def filter(self, keep: list[int]) -> None:
        """Keep rows `keep`; plain steps in flight keep those rows too (a cycle must settle first)."""
        if any(isinstance(step, Flight) for step in self._in_flight):
            raise RuntimeError("rows cannot leave while a cycle is in flight; settle it first")
        self.pipeline.send(PipelineEvent.filter if keep else PipelineEvent.clear)
        self._in_flight = [step.filtered(keep) for step in self._in_flight] if keep else []
        self.y = self.y[mx.array(keep, dtype=mx.int32)] if keep else mx.zeros((0,), mx.uint32)
        self.rows = [self.rows[i] for i in keep]

    # -- drafting ----------------------------------------------------------------------
    def _draw(
        self, logits: mx.array, params: list[SamplingParams | None]
    ) -> tuple[mx.array, list[mx.array | None]]:
        """Draft tokens [B] from head logits [B, V] (rank 0's); per sampled row also its q [1, V]."""
        tokens, qs = draw(logits, params)
        return self.agreed(tokens), qs

    def catch_up(self, plans: list[RowPlan]) -> None:
        """Feed every stale row's pending pairs to the head in one ragged forward."""
        stale = [i for i, r in enumerate(self.rows) if r.pending_t]
        if not stale or self.head is None:
            return
        stacked_h, stacked_t, real = stack_pending(self.rows, stale)
        width = stacked_t.shape[1]
        last = mx.array([max(n - 1, 0) for n in real])
        step_logits, step_hidden = _forward(head_at, self.head, stacked_h, stacked_t, self.head_cache, last)
        self.head_forwards += 1
        rollback.drop_row_suffixes(self.head_cache, [width - n for n in real])
        drafts, qs = self._draw(step_logits, [p.params for p in plans])
        for i in stale:
            row = self.rows[i]
            row.draft, row.q, row.hidden = drafts[i : i + 1], qs[i], step_hidden[i : i + 1]
            row.pending_h, row.pending_t = [], []

    # -- one speculative cycle ----------------------------------------------------------
    def launch(self, plans: list[RowPlan], uids: list[Any] | None = None) -> Flight:
        """Build the cycle's graph and start it on the device (`mx.async_eval`)."""
        PIPELINE.target(self.pipeline.state, PipelineEvent.launch)  # at most two in flight: before any work
        ks = [p.k for p in plans]
        K = max(ks)
        B = len(plans)
        cp = rollback.mark(self.cache)
        head_cp = rollback.mark(self.head_cache)
        before = EngineState.of(self)
        self._drafted = False
        t0 = time.perf_counter()
        try:
            flight = self._build(plans, ks, K, B, cp, head_cp, before)
            t1 = time.perf_counter()
            mx.async_eval(flight.accepted, flight.kept, flight.bonus, flight.inputs, flight.next_draft)
        except BaseException as exc:
            rollback.restore(self.cache, cp)
            rollback.restore(self.head_cache, head_cp)
            before.put_back(self)
            if isinstance(exc, CallerError):
                raise exc.cause from None  # the caller's bug: theirs to see, not a fault
            if isinstance(exc, ForwardFailed):
                raise self._fault(exc.cause, self._drafted) from exc.cause
            raise  # this package's bug: never dressed up as a fault the rows survive
        if self.clock is not None:
            clock = self.clock
            clock.build += t1 - t0
            clock.dispatch += time.perf_counter() - t1
            if clock._last_settle is not None:
                clock.outside += max(t0 - clock._last_settle, 0.0)
        flight.plans, flight.uids = plans, list(range(B)) if uids is None else list(uids)
        self._advance(flight)
        self._in_flight.append(flight)
        self.pipeline.send(PipelineEvent.launch)
        return flight

    @property
    def in_flight(self) -> list[Flight | PlainStep]:
        """Launched steps not yet settled, oldest first."""
        return list(self._in_flight)

    def may_run_ahead(self) -> bool:
        """Whether a step may be launched before the last launched cycle is settled."""
        caches = (self.cache, self.head_cache)
        in_graph = all(rollback.in_graph(c) for c in caches)
        return in_graph and not self.compaction_due()

    def _advance(self, flight: Flight) -> None:
        """The engine's state after the cycle, lazily: what the next step builds on."""
        self.y = flight.bonus.astype(mx.uint32)
        for i, row in enumerate(self.rows):
            row.draft = flight.next_draft[i : i + 1]
            row.q = flight.next_q[i]
            row.hidden = flight.next_hidden[i : i + 1]
            row.pending_h, row.pending_t = [], []

    def _chain_drafts(
        self, plans: list[RowPlan], K: int
    ) -> tuple[list[mx.array], list[list[mx.array | None]], Any]:
        """The cycle's K draft columns [B] (column 0 from the previous cycle, the rest by
        chaining the head), their distributions per sampled row, and the head's chain step."""
        params = [p.params for p in plans]
        live = next(r for r, p in zip(self.rows, plans) if p.k > 0)
        # rows whose head state was dropped (faulted, never primed) ride along on placeholders
        blank_draft, blank_hidden = mx.zeros((1,), mx.uint32), mx.zeros_like(live.hidden)
        columns = [
            mx.concatenate([blank_draft if r.draft is None else r.draft for r in self.rows]).astype(mx.uint32)
        ]
        qcols: list[list[mx.array | None]] = [[r.q for r in self.rows]]
        chained = mx.concatenate([blank_hidden if r.hidden is None else r.hidden for r in self.rows], axis=0)
        chain_step = getattr(self.head, "chain_step", None)  # multi-layer heads: step i runs layer i
        for i in range(1, K):
            if chain_step is None:
                logits, chained = _forward(self.head, chained, columns[-1][:, None], self.head_cache)
            else:  # on the layer's own chain cache, outside the head cache
                logits, chained = _forward(chain_step, i, chained, columns[-1][:, None])
            self.head_forwards += 1
            tokens, qs = self._draw(logits[:, -1], params)
            columns.append(tokens.astype(mx.uint32))
            qcols.append(qs)
        return columns, qcols, chain_step

    def _build(self, plans, ks, K, B, cp, head_cp, before) -> Flight:
        params = [p.params for p in plans]
        self.catch_up(plans)  # rows that decoded plainly since their last cycle
        # 1. drafts: column 0 came from the previous cycle; chain the head for the rest
        columns, qcols, chain_step = self._chain_drafts(plans, K)
        drafts = mx.stack(columns, axis=1)  # [B, K]
        if self.agreement is not None and self.agreement.settle_inputs:
            mx.eval(drafts)  # pipelined ranks: agreed inputs before the forward (distributed.Agreement)
        self._drafted = True
        inputs = mx.concatenate([self.y[:, None], drafts], axis=1)
        # 2. verify, recording recurrent states per position
        captured = capture.supported(self.model, self.cache, captured=self._captured)
        if rollback.needs_capture(self.cache) and not captured:
            raise TypeError("recurrent layers without state capture have no exact rollback")
        armed = capture.arm(self.cache)
        verifying = absorbed_mla.arm(rollback.leaves(self.cache))
        try:
            logits, hidden = _forward(forward_with_hidden, self.model, inputs, self.cache)
        finally:
            steps = capture.collect(armed)
            absorbed_mla.disarm(verifying)
        self.target_forwards += 1
        logprobs = processed_logprobs(plans, logits, inputs)
        # 3. acceptance on the device
        accepted, bonus = self._accept(plans, ks, K, drafts, qcols, logprobs)
        if self.agreement is not None:  # one exchange for both
            both = self.agreed(mx.stack([accepted.astype(mx.int32), bonus.astype(mx.int32)]))
            accepted, bonus = both[0], both[1].astype(bonus.dtype)
        accepted, kept, bonus = cap_accepted(plans, ks, K, drafts, accepted, bonus)
        if armed:
            capture.select(armed, steps, kept + 1)
        in_graph = rollback.in_graph(self.cache) and rollback.in_graph(self.head_cache)
        if in_graph:  # the next step may be built before this one's outcome is on the host
            rollback.drop_row_suffixes(self.cache, K - kept, skip_recurrent=True)
        # 4. the head: drop the chained entries, catch up on the verified block, draft next
        if K > 1 and chain_step is None:
            rollback.trim_all(self.head_cache, K - 1)
        pos = mx.arange(K + 1)[None]
        padded = mx.concatenate([drafts, mx.zeros((B, 1), mx.uint32)], axis=1)
        pair_tokens = mx.where(pos < kept[:, None], padded, bonus[:, None].astype(mx.uint32))
        marked = absorbed_mla.arm(rollback.leaves(self.head_cache))
        try:
            # the accepted slot's draft only: one row of the output projection per row
            head_logits, next_hidden = _forward(
                head_at, self.head, hidden, pair_tokens, self.head_cache, kept
            )
        finally:
            absorbed_mla.disarm(marked)
        self.head_forwards += 1
        if in_graph:
            rollback.drop_row_suffixes(self.head_cache, K - kept)
        next_draft, next_q = self._draw(head_logits, params)
        return Flight(
            K=K,
            ks=ks,
            inputs=inputs,
            logprobs=logprobs,
            accepted=accepted,
            kept=kept,
            bonus=bonus,
            next_draft=next_draft.astype(mx.uint32),
            next_q=next_q,
            next_hidden=next_hidden,
            mark=cp,
            head_mark=head_cp,
            before=before,
            in_graph=in_graph,
        )

    def _accept(self, plans, ks, K, drafts, qcols, logprobs) -> tuple[mx.array, mx.array]:
        """Accept counts [B] and bonus tokens [B], on the device."""
        B = len(plans)
        targets = mx.argmax(logprobs, axis=-1)  # [B, K + 1]
        allowed = mx.arange(K)[None] < mx.array(ks)[:, None]
        match = (drafts == targets[:, :K].astype(drafts.dtype)) & allowed
        accepted = mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1)
        bonus = mx.take_along_axis(targets, accepted[:, None], axis=1)[:, 0]
        rows = mx.arange(B)
        for i, plan in enumerate(plans):
            if plan.greedy:
                continue
            if ks[i] == 0:  # plain ride-along: the row's own sampler, as mlx-lm draws
                token = call_caller(plan.sampler, logprobs[i, 0:1]).reshape(())
                a = mx.array(0, mx.int32)
            else:
                q = mx.concatenate([qcols[j][i] for j in range(ks[i])], axis=0)
                a, token = accept_sampled(drafts[i, : ks[i]], q, logprobs[i, : ks[i] + 1], plan.params)
            accepted = mx.where(rows == i, a, accepted)
            bonus = mx.where(rows == i, token.astype(bonus.dtype), bonus)
        return accepted, bonus

    def settle(self, flight: Flight) -> Settled:
        """The cycle's one sync; trims the caches to each row's accepted prefix.

        Flights settle in launch order. A step launched after this one keeps running;
        if this one fails, both are undone (`SpeculativeFault`) and the later one is void.
        """
        self._check_next(flight)
        t0 = time.perf_counter()
        try:
            mx.eval(flight.accepted, flight.kept, flight.bonus, flight.inputs, flight.next_draft)
        except Exception as exc:
            self._undo(flight, PipelineEvent.fault)
            raise self._fault(exc, True) from exc
        t1 = time.perf_counter()
        self._in_flight.pop(0)
        self.pipeline.send(PipelineEvent.settle)
        accepted, kept = flight.accepted.tolist(), flight.kept.tolist()
        fed = flight.inputs.tolist()
        bonus = flight.bonus.tolist()
        drop = [flight.K - a for a in kept]
        if flight.in_graph:  # rolled back in the graph: the host learns how far
            last = not self._in_flight  # nothing written since: shared holes end the buffer
            rollback.count_holes(self.cache, drop, at_tail=last)
            rollback.count_holes(self.head_cache, drop, at_tail=last)
            if last:  # reshaping waits for a moment with nothing in flight
                rollback.compact_if_due(self.cache)
                rollback.compact_if_due(self.head_cache)
        else:  # recurrent leaves already hold their captured states (selected in the graph)
            rollback.drop_row_suffixes(self.cache, drop, skip_recurrent=True)
            rollback.drop_row_suffixes(self.head_cache, drop)
        tokens = [fed[i][1 : a + 1] + [bonus[i]] for i, a in enumerate(kept)]
        drafts = [fed[i][1 : 1 + k] for i, k in enumerate(flight.ks)]
        if self.clock is not None:
            clock = self.clock
            clock._last_settle = time.perf_counter()
            clock.cycles += 1
            clock.sync += t1 - t0
            clock.rollback += clock._last_settle - t1
        return Settled(accepted, tokens, flight.logprobs, drafts, kept)

    def abandon(self, step: Flight | PlainStep) -> None:
        """Undo a launched step that will never be settled (the consumer stopped, or the
        policy's verdict changed while it ran ahead); steps launched after it are void.
        A void or settled step is left alone."""
        if any(step is s for s in self._in_flight):
            self._undo(step)

    def _check_next(self, step: Flight | PlainStep) -> None:
        if not self._in_flight or self._in_flight[0] is not step:
            raise RuntimeError("steps settle once each, in launch order (a void step cannot settle)")

    def _undo(self, step: Flight | PlainStep, event: PipelineEvent = PipelineEvent.abandon) -> None:
        if step.before is None or step.mark is None or step.head_mark is None:
            raise RuntimeError("a plain step launched before a batch reshape cannot be undone")
        at = next(i for i, s in enumerate(self._in_flight) if s is step)
        self.pipeline.send(event, newest=at == len(self._in_flight) - 1)
        voided = sum(isinstance(s, Flight) and s.in_graph for s in self._in_flight[at:])
        rollback.restore(self.cache, step.mark, voided)
        rollback.restore(self.head_cache, step.head_mark, voided)
        step.before.put_back(self)
        self.abandoned_steps += len(self._in_flight) - at
        del self._in_flight[at:]

    # -- plain steps -----------------------------------------------------------------------
    def plain(self, plans: list[RowPlan], uids: list[Any] | None = None) -> PlainStep:
        """One plain forward of every row's y: next tokens [B] and log-probs [B, V], lazy.

        The hidden state waits as a pending head pair (fed at the next catch-up). The
        step keeps a mark, so the latest step can be abandoned like a cycle.
        """
        PIPELINE.target(self.pipeline.state, PipelineEvent.launch)  # at most two in flight: before any work
        step_mark = (rollback.mark(self.cache), rollback.mark(self.head_cache), EngineState.of(self))
        logits, hidden = forward_with_hidden(self.model, self.y[:, None], self.cache)
        self.target_forwards += 1
        try:
            logprobs = processed_logprobs(plans, logits, self.y[:, None])[:, 0]
            tokens = mx.argmax(logprobs, axis=-1)
            rows = mx.arange(len(plans))
            for i, plan in enumerate(plans):
                if not plan.greedy:
                    drawn = call_caller(plan.sampler, logprobs[i : i + 1]).reshape(())
                    tokens = mx.where(rows == i, drawn, tokens)
        except CallerError as exc:
            raise exc.cause from None
        tokens = self.agreed(tokens.astype(mx.uint32))
        if self.head is not None:
            for i, row in enumerate(self.rows):
                if row.draft is not None or row.pending_t:  # rows whose head is live
                    row.pending_h.append(hidden[i, -1:])
                    row.pending_t.append(tokens[i : i + 1])
            if max(len(r.pending_t) for r in self.rows) >= PENDING_FLUSH:
                try:
                    self.catch_up(plans)
                except ForwardFailed as exc:  # a head that fails here fails the next cycle too: drop it
                    if self.agreement is not None:
                        raise self._fault(exc.cause, False) from exc.cause
                    for row in self.rows:
                        self.forget(row)
        self.y = tokens
        ids = list(range(len(plans))) if uids is None else list(uids)
        step = PlainStep(tokens, logprobs, *step_mark, plans, ids)
        self._in_flight.append(step)
        self.pipeline.send(PipelineEvent.launch)
        return step

    def settle_plain(self, step: PlainStep) -> list[int]:
        """Sync a plain step: its tokens on the host (an error propagates: plain steps
        are mlx-lm's own forward, not speculative faults)."""
        self._check_next(step)
        tokens = step.tokens.tolist()
        self._in_flight.pop(0)
        self.pipeline.send(PipelineEvent.settle)
        if not self._in_flight:  # plain steps grow window caches too: reclaim while nothing runs
            rollback.compact_if_due(self.cache)
            rollback.compact_if_due(self.head_cache)
        return tokens

    def compaction_due(self) -> bool:
        """Some cache waits for a moment with no step in flight to be compacted."""
        return any(rollback.compaction_due(c) for c in (self.cache, self.head_cache))
