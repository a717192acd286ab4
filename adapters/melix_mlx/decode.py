"""Single-sequence MTP speculative decoding: the cycle engine at B = 1, pipelined.
(Over 400 lines: the one-sequence loop with its run-ahead, quantized-KV boundary and cache
form read together; the rules of a step it shares with the batch live in step_rules.py.)

Rules of this module:
- Output identity: greedy output equals mlx-lm's `generate_step` token for token, and
  sampled output has mlx-lm's sampling distribution (melix_mlx.sampling). The target
  model decides every emitted token; drafts only decide how many come per forward.
- The cycle itself (drafts, verify, acceptance on the device, head catch-up, rollback
  without replay) is melix_mlx.engine's, shared with the batched generator.
- Host work overlaps device work as in mlx-lm's `generate_step`: each step (a cycle or a
  plain forward) is launched with `mx.async_eval` BEFORE the previous step's tokens are
  yielded, so the caller's detokenizing and this module's bookkeeping run while the
  device computes. After a plain step the next step is built on its lazy token before
  it is synced, exactly as `generate_step` pipelines. After a cycle that happens with
  `run_ahead` (default on a GPU: melix_mlx.engine.run_ahead_default), and needs a
  rollback that runs in the graph: the sequence then decodes on
  one-row batch caches (mlx-lm's own `merge`, melix_mlx.ragged_kv) and is handed back in
  mlx-lm's single-sequence form when the generator ends. Logits processors (the host's
  token history), quantized KV (host offsets) and sliding windows (their own cache)
  never run ahead.
- A step launched ahead follows the verdict that stood at its launch. If settling the
  step before it changes the verdict (suspended, resumed, faulted, a smaller depth),
  the ahead step is abandoned (its marks restored) and relaunched: a suspended window
  never drafts.
- Every draft, verify, accept/rollback, plain step and fault is a transition of the
  sequence's lifecycle machine (melix_fsm.lifecycle), sent when the step's outcome is
  known; its counters are the statistics.
- An exception inside the head or the verify moves the sequence to faulted: the caches
  are restored and decoding continues plainly from the last confirmed token. No token
  is lost; the fault is counted and its message kept in `fault_message`.
- A generator closed early leaves the cache holding the prompt and every yielded token
  but the last (in-flight steps are undone), in mlx-lm's single-sequence form.
- Quantized KV (`kv_bits`, `kv_group_size`, `quantized_kv_start`, as in mlx-lm) uses
  mlx-lm's own conversion at mlx-lm's moments: after every prefill chunk and before
  every step, layers whose offset reached the start become QuantizedKVCache (which
  trims exactly). mlx-lm computes a position with the quantized cache iff the position
  is at or past the start, so a verify never straddles it: cycles are capped to end
  before it, and the one step at the start is taken plainly (suspend, plain step,
  resume: real lifecycle transitions).
- Refusals found here are typed: `refusal` is `"<RefusalReason>: <detail>"` and the
  stats carry `refusal_reason` (melix_fsm.reasons).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, _merge_caches, maybe_quantize_kv_cache
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from melix_fsm import lifecycle as lc
from melix_fsm.lifecycle import SequenceMachine
from melix_fsm.reasons import RefusalReason, reason_of, refusal_text

from . import head_receipt, ragged_kv, rollback, step_rules, window_kv
from .engine import CycleEngine, run_ahead_default
from .engine_records import Flight, PlainStep, RowHead, RowPlan, SpeculativeFault
from .errors import check_kv_group
from .hidden import main_parts
from .prefill import check_prompt, prefill_with_hidden
from .sampling import UNKNOWN_SAMPLER, SamplingParams, normalize_logits, params_of
from .token_history import TokenHistory

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Sampler = Callable[[mx.array], mx.array]
Emitted = tuple[int, mx.array, bool]



class MTPDecoder:
    """Decode one sequence with an MTP head; see the module rules.

    Use `generate(prompt, max_tokens)`, which yields `(token, logprobs, from_draft)`
    like mlx-lm's `speculative_generate_step`. `machine.counters` and the forward
    counts are the statistics.
    """

    def __init__(
        self,
        model: nn.Module,
        head: nn.Module | None,
        *,
        num_draft_tokens: int = 1,
        sampler: Sampler | None = None,
        logits_processors: list[LogitsProcessor] | None = None,
        prompt_cache: list[Any] | None = None,
        prefill_step_size: int = 2048,
        machine: SequenceMachine | None = None,
        refusal: str | None = None,
        controller: Any = None,
        clock: Any = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
        run_ahead: bool | None = None,
    ) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        check_kv_group(main_parts(model).args, kv_bits, kv_group_size)  # UnsupportedServing
        self.model = model
        self.head = head
        self.k = num_draft_tokens
        self.sampler = sampler
        self.params: SamplingParams | None = params_of(sampler)
        self.processors = tuple(logits_processors or ())
        cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
        head_cache = head.make_cache() if head is not None else []
        self.engine = CycleEngine(model, head, cache, head_cache)
        self.engine.clock = clock  # melix_mlx.cycle_clock.CycleClock: where cycle time goes (bench)
        self.prefill_step_size = prefill_step_size
        self.kv_bits, self.kv_group_size, self.quantized_kv_start = kv_bits, kv_group_size, quantized_kv_start
        self._boundary_pause = False  # suspended for the one plain step at quantized_kv_start
        self.machine = machine if machine is not None else SequenceMachine(uid=0)
        self.fault_message: str | None = None
        self.refusal = refusal or self._refusal_reason()
        self.controller = controller  # melix_fsm.policy.controller.LiveController, or None: always on
        self._history: TokenHistory | None = None  # prompt and every yielded token (processors only)
        self._last_step_end: float | None = None
        # build step n + 1 before step n syncs (melix_mlx.engine.run_ahead_default: on a GPU)
        self.run_ahead = run_ahead_default() if run_ahead is None else run_ahead
        self._single_form: list[Any] | None = None  # the caller's cache list while rows run batch-form
        self._deferred_fault: tuple[SpeculativeFault, int] | None = None  # from a launch ahead
        self._plain_ahead = False  # a plain step launched ahead is running (see _reconcile)
        self._budget: int | None = None  # tokens the run may still emit before this step (None: no cap)

    @property
    def cache(self) -> list[Any]:
        return self.engine.cache

    @property
    def head_cache(self) -> list[Any]:
        return self.engine.head_cache

    # -- admission ---------------------------------------------------------------
    def _refusal_reason(self) -> str | None:
        if self.head is None:
            return refusal_text(RefusalReason.unsupported_model, "no MTP head loaded")
        refused = head_receipt.refusal(self.head)  # the receipt loaded with the head refuses
        if refused:
            return refused
        if self.params is None:
            return refusal_text(RefusalReason.unsupported_sampler, UNKNOWN_SAMPLER)
        return rollback.refusal(self.cache, model=self.model)

    def _resolve(self) -> None:
        if self.machine.state is lc.INITIAL:
            reason = self.refusal or ""
            self.machine.send(lc.Signal(event=(lc.REFUSE if self.refusal else lc.ADMIT).event, reason=reason))
        elif self.refusal and self.machine.allows(lc.REFUSE.event):
            # Admitted before loading (by a receipt), refused by what only the loaded
            # decoder knows (sampler, cache kinds): the spec's late refusal, for good.
            self.machine.send(lc.Signal(event=lc.REFUSE.event, reason=self.refusal))
            self.controller = None

    # -- steps -----------------------------------------------------------------------
    def _plan(self, k: int, remaining: int | None = None) -> RowPlan:
        """The row's plan; `remaining` caps the drafts a cycle keeps (RowPlan.keep), so the
        caches never hold a token the caller was not given."""
        history = self._history.upto(len(self._history) - 1) if self._history is not None else None
        return RowPlan(k, self.params, self.sampler, self.processors, history, remaining)

    def _depth(self, remaining: int) -> int:
        """Drafts for the next cycle; 0 means the next step decodes plainly."""
        if (self.machine.state not in lc.CYCLE_READY and not self._resuming()) or self.refusal:
            return 0
        if self.controller is not None and not self.controller.speculating:
            return 0
        depth = getattr(self.controller, "k", self.k) if self.controller is not None else self.k
        room = self._room_before_quantization()
        if room == 0:  # the step at quantized_kv_start is plain (see the module rules)
            self.machine.send(lc.Signal(event=lc.SUSPEND.event, reason="plain step at quantized_kv_start"))
            self._boundary_pause = True
            return 0
        if room is not None:
            depth = min(depth, room)
        return step_rules.cycle_depth(depth, remaining)  # a cycle-ready machine takes no plain step

    def _resuming(self) -> bool:
        """The controller resumed speculation while a plain step launched ahead ran: the
        lifecycle resumes once that step settles (`_reconcile`); the next step is a cycle."""
        if self.controller is None or not self.controller.speculating or self._boundary_pause:
            return False
        return self.machine.state in lc.STEERABLE and self.machine.allows(lc.RESUME.event)

    def _room_before_quantization(self) -> int | None:
        """Drafts a verify may carry and still end before quantized_kv_start (None: no limit)."""
        if self.kv_bits is None:
            return None
        offsets = [c.offset for c in self.cache if hasattr(c, "to_quantized")]
        if not offsets or offsets[0] >= self.quantized_kv_start:
            return None
        return self.quantized_kv_start - 1 - offsets[0]

    def _quantize(self) -> None:
        """mlx-lm's own KV conversion, at the moments mlx-lm applies it."""
        maybe_quantize_kv_cache(self.cache, self.quantized_kv_start, self.kv_group_size, self.kv_bits)

    def _start(self, remaining: int) -> Flight | PlainStep:
        if self._plain_ahead:  # a resume put off for a plain step since voided (a fault)
            self._plain_ahead = False
            self._reconcile()  # ... applies now
        self._quantize()
        k = self._depth(remaining)
        if k > 0:
            try:
                return self.engine.launch([self._plan(k, remaining)])
            except SpeculativeFault as fault:
                self._fault(fault, k)
        return self._plain()

    def _plain(self) -> PlainStep:
        step = self.engine.plain([self._plan(0)])
        mx.async_eval(step.tokens)
        return step

    def _launch_ahead(self, step: Flight | PlainStep, remaining: int) -> Flight | PlainStep | None:
        """Step n + 1, built on `step`'s lazy outcome before `step` is synced (or None).

        `remaining` counts the tokens still wanted before `step`; the ahead step plans for
        the fewest that can remain after it. A fault while building it is recorded after
        `step` settles (the lifecycle sees events in step order).
        """
        if self.processors or self.kv_bits is not None:
            return None  # processors read the host's history; quantization, host offsets
        # after a plain step nothing waits for the host: mlx-lm's own pipelining, always
        if not step_rules.may_build_on(isinstance(step, Flight), self.run_ahead, self.engine):
            return None
        left = remaining - (step.ks[0] + 1 if isinstance(step, Flight) else 1)
        if left <= 0:
            return None
        k = self._depth(left)
        if k == 0:
            return self._plain()
        if not step_rules.may_launch_cycle_ahead(self.run_ahead, self.controller):
            return None
        try:
            return self.engine.launch([self._plan(k, left)])
        except SpeculativeFault as fault:
            self._deferred_fault = (fault, k)
            return None

    def _still_valid(self, ahead: Flight | PlainStep | None) -> Flight | PlainStep | None:
        """Keep a step launched ahead only if the verdict that launched it still stands
        (speculating or not, and no deeper than the depth now allowed)."""
        if ahead is None:
            return None
        speculating = self.machine.state in lc.CYCLE_READY and not self.refusal
        depth = getattr(self.controller, "k", self.k) if self.controller is not None else self.k
        then = ahead.ks[0] if isinstance(ahead, Flight) else 0
        # a resume waits for a plain step running ahead (`_reconcile`): the row is not resuming
        if step_rules.ahead_fits([then], [depth if speculating else 0], [False]):
            return ahead
        self.engine.abandon(ahead)
        return None

    def _finish(self, step: Flight | PlainStep) -> list[Emitted] | None:
        """Sync one launched step and record it; None when a cycle faulted."""
        if isinstance(step, PlainStep):
            token = self.engine.settle_plain(step)[0]
            signals = step_rules.step_signals(0, 0)
            out = [(token, step.logprobs[0], False)]
        else:
            try:
                settled = self.engine.settle(step)
            except SpeculativeFault as fault:
                self._fault(fault, step.ks[0])
                return None
            a = settled.accepted[0]
            signals = step_rules.step_signals(step.ks[0], a)
            out = [(t, settled.logprobs[0, j], j < a) for j, t in enumerate(settled.tokens[0])]
        for signal in signals:
            self.machine.send(signal)
        if self._boundary_pause and isinstance(step, PlainStep):  # the plain step at the start is done
            self._boundary_pause = False
            self.machine.send(lc.Signal(event=lc.RESUME.event, reason="past quantized_kv_start"))
        self._observe(signals, len(out))
        return out

    def _observe(self, signals: list[lc.Signal], tokens: int) -> None:
        """Feed the controller this step's outcome and wall time."""
        now = time.perf_counter()
        seconds = None if self._last_step_end is None else now - self._last_step_end
        self._last_step_end = now
        if self.controller is None or self.machine.state not in lc.STEERABLE:
            return
        remaining = None if self._budget is None else max(self._budget - tokens, 0)
        step_rules.feed(self.controller, 1, [signals], seconds=seconds, tokens=tokens, remaining=remaining)
        self._reconcile()

    def _fault(self, fault: SpeculativeFault, k: int) -> None:
        self.fault_message = str(fault)
        recorded, faulted = step_rules.fault_signals(k, fault.drafted, self.fault_message)
        for signal in (*recorded, faulted):
            self.machine.send(signal)
        for row in self.engine.rows:  # faulted for good: the head does no more work
            self.engine.forget(row)

    def generate(self, prompt: mx.array, max_tokens: int = 256) -> Iterator[Emitted]:
        """Yield up to `max_tokens` tokens as `(token, logprobs, from_draft)`.

        Raises InvalidPrompt (before any forward) for an empty prompt or unknown token ids.
        """
        check_prompt(self.model, prompt.tolist())
        self._resolve()
        self._reconcile()  # a start the gate disabled begins suspended
        logits, hiddens = prefill_with_hidden(
            self.model, prompt, self.cache, self.prefill_step_size, after_chunk=self._quantize
        )
        window_kv.adopt(self.cache)  # sliding windows roll back exactly from here on
        prompt_tokens = prompt.tolist()
        logprobs = self._process(logits, prompt_tokens)
        first = mx.argmax(logprobs, axis=-1) if self.sampler is None else self.sampler(logprobs)
        y = int(self.engine.agreed(first).item())  # rank 0's draw under mx.distributed
        row = RowHead()
        disabled = getattr(self.controller, "disabled", False)  # never speculates: no head work
        if self.head is not None and self.refusal is None and not disabled:
            pairs = [*prompt_tokens[1:], y]
            row = self.engine.prime(self.head_cache, hiddens, pairs, self.params, self.prefill_step_size)
            if self.controller is None or self.controller.speculating:
                # the head's pass over the prompt is prompt processing (the batch path's
                # rows are primed the same way): before the first token, not in the first
                # cycle. A start the controller suspends leaves it lazy: the first
                # speculative probe, if one comes, evaluates it.
                mx.eval(row.draft, row.hidden, [c.state for c in self.head_cache])
        self.engine.extend(mx.array([y]), [row])
        if self.processors:
            self._history = TokenHistory([*prompt_tokens, y])  # everything before y, then y
        produced = 1
        step: Flight | PlainStep | None = None
        ahead: Flight | PlainStep | None = None
        try:
            if row.draft is not None:
                self._enter_batch_form()
            yield y, logprobs[-1], False
            while max_tokens < 0 or produced < max_tokens:
                remaining = max_tokens - produced if max_tokens >= 0 else 2 * self.k + 2
                if step is None:
                    step = self._start(remaining)
                ahead = self._launch_ahead(step, remaining)
                self._plain_ahead = isinstance(ahead, PlainStep)
                self._budget = remaining if max_tokens >= 0 else None
                out = self._finish(step)
                step = None
                if self._deferred_fault is not None:
                    self._fault(*self._deferred_fault)
                    self._deferred_fault = None
                if out is None:
                    ahead = None  # faulted: undoing the cycle voided the step built on it
                    continue  # the next iteration decodes y plainly
                ahead = self._still_valid(ahead)
                out = out[:remaining]
                if self._history is not None:
                    self._history.extend([t for t, _, _ in out])
                produced += len(out)
                if max_tokens < 0 or produced < max_tokens:
                    # overlap: the device runs the next step while the caller consumes these
                    step = ahead or self._start(max_tokens - produced if max_tokens >= 0 else 2 * self.k + 2)
                elif ahead is not None:
                    self.engine.abandon(ahead)
                ahead = None
                yield from out
        finally:
            for launched in (step, ahead):  # undoing the earlier voids the later
                if launched is not None:
                    self.engine.abandon(launched)
            self._leave_batch_form()

    def _enter_batch_form(self) -> None:
        """Run the cycles on one-row batch caches, whose rollback runs in the graph.

        Only where mlx-lm's merge gives an exact one-row twin: plain KV and (captured)
        recurrent layers, no processors, no quantized KV. Anything else stays in its
        own form and rolls back after each sync.
        """
        cache, head_cache = self.engine.cache, self.engine.head_cache
        if not self.run_ahead or self.processors or self.kv_bits is not None:
            return
        kinds = (KVCache, ArraysCache)
        if not all(type(c) in kinds for c in cache) or not all(type(c) is KVCache for c in head_cache):
            return
        self._single_form = cache
        self.engine.cache = ragged_kv.adopt(_merge_caches([cache]))
        self.engine.head_cache = ragged_kv.adopt(_merge_caches([head_cache]))

    def _leave_batch_form(self) -> None:
        """Hand the caches back in mlx-lm's single-sequence form, in the caller's list."""
        if self._single_form is None:
            return
        single, self._single_form = self._single_form, None
        for i, c in enumerate(self.engine.cache):
            single[i] = c.extract(0)
        self.engine.cache = single
        self.engine.head_cache = [c.extract(0) for c in self.engine.head_cache]

    def _process(self, logits: mx.array, prompt: list[int]) -> mx.array:
        """Processed log-probabilities [1, V] of the prefill's last logits."""
        if self.processors:
            history = mx.array(prompt)
            for processor in self.processors:
                logits = processor(history, logits)
        return normalize_logits(logits)

    def _reconcile(self) -> None:
        """Bring the lifecycle in line with the controller's verdict: suspend or resume.

        The verdict, not the returned action, is the truth: a window the controller calls
        plain is a suspended window, whatever led there.
        """
        if self.controller is None:
            return
        # a plain step launched ahead belongs to the suspended window it was launched in:
        # it settles as a plain step, and the row resumes after it (`_resuming`), so the
        # switch undoes nothing
        signal, rows = step_rules.steer(self.controller, [self.machine.state], [self._plain_ahead])
        if rows:
            self.machine.send(signal)

    @property
    def stats(self) -> dict[str, Any]:
        """Counters of the lifecycle machine plus forward counts, as plain data."""
        out = self.machine.counters.summary()
        out.update(
            state=self.machine.state.value,
            target_forwards=self.engine.target_forwards,
            replay_forwards=self.engine.replay_forwards,
            head_forwards=self.engine.head_forwards,
            abandoned_steps=self.engine.abandoned_steps,
            refusal=self.refusal,
            refusal_reason=reason_of(self.refusal),
            fault=self.fault_message,
            policy=self.controller.summary() if self.controller is not None else None,
        )
        return out
