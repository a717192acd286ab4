"""Single-sequence MTP speculative decoding: the B = 1 client of the step pipeline.

`MTPDecoder` admits one sequence (prefill, first token, head primed) and emits its
tokens; every step is melix_mlx.decoding.step_driver.StepPipeline's, the one the batched
generator drives (as mlx-lm's single-sequence functions sit over its batch objects).
What only one sequence has stays here: the quantized-KV boundary, mlx-lm's
single-sequence cache form, an unbounded run (`max_tokens < 0`).

Rules of this module:
- Output identity: greedy output equals mlx-lm's `generate_step` token for token, and
  sampled output has mlx-lm's sampling distribution (melix_mlx.runtime.sampling). The target
  model decides every emitted token; drafts only decide how many come per forward.
- The cycle itself (drafts, verify, acceptance on the device, head catch-up, rollback
  without replay) is melix_mlx.runtime.engine's, and the step around it (plan, launch, run
  ahead, validate, settle, lifecycle events, policy feedback) melix_mlx.decoding.step_driver's,
  both shared with the batched generator.
- Host work overlaps device work as in mlx-lm's `generate_step`: each step (a cycle or a
  plain forward) is launched with `mx.async_eval` BEFORE the previous step's tokens are
  yielded, so the caller's detokenizing and this module's bookkeeping run while the
  device computes. After a plain step the next step is built on its lazy token before
  it is synced, exactly as `generate_step` pipelines. After a cycle that happens with
  `run_ahead` (default on a GPU: melix_mlx.decoding.step_driver.run_ahead_default), and needs a
  rollback that runs in the graph: the sequence then decodes on
  one-row batch caches (mlx-lm's own `merge`, melix_mlx.runtime.ragged_kv; sliding windows
  melix_mlx.runtime.window_batch) and is handed back in mlx-lm's single-sequence form
  when the generator ends (a window as mlx-lm's RotatingKVCache; a head's window as a
  window that evicts nothing again). Logits processors (the host's token history),
  quantized KV (host offsets) and windows that keep their first tokens (`max_kv_size`)
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

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, _merge_caches, maybe_quantize_kv_cache
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from melix_fsm import lifecycle as lc
from melix_fsm.batch import Operation
from melix_fsm.lifecycle import SequenceMachine
from melix_fsm.reasons import RefusalReason, reason_of, refusal_text

from ..loading import head_receipt
from ..loading.errors import check_kv_group
from ..runtime import (
    batch_caches,
    layer_kv,
    ragged_kv,  # noqa: F401 - public: melix_mlx.decode re-exports it
    rollback,
    window_kv,
)
from ..runtime.engine import CycleEngine
from ..runtime.engine_records import RowHead, RowPlan
from ..runtime.hidden import main_parts
from ..runtime.prefill import check_prompt, prefill_with_hidden
from ..runtime.sampling import UNKNOWN_SAMPLER, SamplingParams, normalize_logits, params_of
from ..runtime.token_history import TokenHistory
from . import step_rules
from .step_driver import StepOutcome, StepPipeline, run_ahead_default

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
        self.engine.clock = clock  # melix_mlx.runtime.cycle_clock.CycleClock: where cycle time goes (bench)
        self.prefill_step_size = prefill_step_size
        self.kv_bits, self.kv_group_size, self.quantized_kv_start = kv_bits, kv_group_size, quantized_kv_start
        self._boundary_pause = False  # suspended for the one plain step at quantized_kv_start
        self.machine = machine if machine is not None else SequenceMachine(uid=0)
        self.fault_message: str | None = None
        self.refusal = refusal or self._refusal_reason()
        self._history: TokenHistory | None = None  # prompt and every yielded token (processors only)
        self._single_form: list[Any] | None = None  # the caller's cache list while rows run batch-form
        self._remaining = 0  # tokens the run still wants before the next step to settle
        self._budget: int | None = None  # the same, for the controller (None: no cap)
        # build step n + 1 before step n syncs (melix_mlx.decoding.step_driver.run_ahead_default: on a GPU)
        run_ahead = run_ahead_default() if run_ahead is None else run_ahead
        # controller: a melix_fsm.policy.controller.LiveController, or None: always on
        self.steps = StepPipeline(self.engine, self, controller, run_ahead)

    @property
    def controller(self) -> Any:
        return self.steps.controller

    @property
    def run_ahead(self) -> bool:
        return self.steps.run_ahead

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
        return rollback.refusal(self.cache, model=self.model, quantized_kv=self.kv_bits is not None)

    def _resolve(self) -> None:
        if self.machine.state is lc.INITIAL:
            reason = self.refusal or ""
            self.machine.send(lc.Signal(event=(lc.REFUSE if self.refusal else lc.ADMIT).event, reason=reason))
        elif self.refusal and self.machine.allows(lc.REFUSE.event):
            # Admitted before loading (by a receipt), refused by what only the loaded
            # decoder knows (sampler, cache kinds): the spec's late refusal, for good.
            self.machine.send(lc.Signal(event=lc.REFUSE.event, reason=self.refusal))
            self.steps.controller = None

    # -- the B = 1 client of the step pipeline ---------------------------------------
    def step_uids(self) -> list[Any]:
        return [0]

    def step_states(self) -> list[lc.State]:
        return [self.machine.state]

    def plan_step(self, before: list[RowPlan] | None) -> list[RowPlan]:
        """The row's plan for the next step; `before`: a step not yet settled, after which
        the fewest tokens remain. A cycle's `remaining` caps the drafts it keeps
        (RowPlan.keep), so the caches never hold a token the caller was not given."""
        remaining = self._remaining - (before[0].k + 1 if before else 0)
        k = self._depth(remaining)
        history = self._history.upto(len(self._history) - 1) if self._history is not None else None
        return [RowPlan(k, self.params, self.sampler, self.processors, history, remaining if k else None)]

    def may_plan_ahead(self, plans: list[RowPlan]) -> bool:
        """Processors read the host's history and quantization the host's offsets: never
        ahead; nor a step the run has no tokens left for."""
        if self.processors or self.kv_bits is not None:
            return False
        return self._remaining - (plans[0].k + 1) > 0

    def apply_signals(self, operation: Operation, signals: dict[Any, lc.Signal | list[lc.Signal]]) -> None:
        """Send the row's lifecycle events; a fault's message is kept in `fault_message`."""
        for sent in signals.values():
            if operation is Operation.fault and isinstance(sent, lc.Signal):
                self.fault_message = sent.reason
            for signal in [sent] if isinstance(sent, lc.Signal) else sent:
                self.machine.send(signal)

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
        lifecycle resumes once that step settles (StepPipeline.reconcile); the next step is a cycle."""
        if self._boundary_pause or not self.steps.resuming(self.machine.state):
            return False
        return self.machine.allows(lc.RESUME.event)

    def _room_before_quantization(self) -> int | None:
        """Drafts a verify may carry and still end before quantized_kv_start (None: no limit)."""
        if self.kv_bits is None:
            return None
        offsets = [c.offset for c in self.cache if hasattr(c, "to_quantized")]
        if not offsets or offsets[0] >= self.quantized_kv_start:
            return None
        return self.quantized_kv_start - 1 - offsets[0]

    def _quantize(self) -> None:
        """mlx-lm's own KV conversion, at the moments mlx-lm applies it: after each prefill
        chunk and before a step is launched (never under a step in flight)."""
        if self.kv_bits is not None and self.steps.ahead is None:
            maybe_quantize_kv_cache(self.cache, self.quantized_kv_start, self.kv_group_size, self.kv_bits)

    def _settled(self, outcome: StepOutcome) -> list[Emitted]:
        """The step's tokens; after the plain step at quantized_kv_start the row resumes;
        the controller sees the step's outcome and wall time."""
        settled, k = outcome.settled, outcome.plans[0].k
        a = settled.accepted[0]
        out = [(t, settled.logprobs[0, j], j < a) for j, t in enumerate(settled.tokens[0])]
        if self._boundary_pause and k == 0:  # the plain step at the start is done
            self._boundary_pause = False
            self.machine.send(lc.Signal(event=lc.RESUME.event, reason="past quantized_kv_start"))
        seconds = self.steps.step_seconds()
        if self.machine.state in lc.STEERABLE:
            remaining = None if self._budget is None else max(self._budget - len(out), 0)
            signals = outcome.signals.values()
            self.steps.feed(1, signals, seconds=seconds, tokens=len(out), remaining=remaining)
        return out

    def generate(self, prompt: mx.array, max_tokens: int = 256) -> Iterator[Emitted]:
        """Yield up to `max_tokens` tokens as `(token, logprobs, from_draft)`.

        Raises InvalidPrompt (before any forward) for an empty prompt or unknown token ids.
        """
        y, logprobs = self._start(prompt)
        produced = 1
        try:
            yield y, logprobs, False
            while max_tokens < 0 or produced < max_tokens:
                self._remaining = max_tokens - produced if max_tokens >= 0 else 2 * self.k + 2
                self._budget = self._remaining if max_tokens >= 0 else None
                self._quantize()
                outcome = self.steps.step()
                if outcome is None:
                    continue  # faulted: the next step decodes y plainly
                out = self._settled(outcome)[: self._remaining]
                self.steps.record_ahead_fault()
                if self._history is not None:
                    self._history.extend([t for t, _, _ in out])
                produced += len(out)
                if max_tokens < 0 or produced < max_tokens:
                    # overlap: the device runs the next step while the caller consumes these
                    self._remaining = max_tokens - produced if max_tokens >= 0 else 2 * self.k + 2
                    self.steps.check_ahead()
                    self._quantize()
                    self.steps.launch_next()
                else:
                    self.steps.abandon_ahead()
                yield from out
        finally:
            self.steps.abandon_ahead()  # undone: the caches hold what was yielded but the last
            self._leave_batch_form()

    def _start(self, prompt: mx.array) -> tuple[int, mx.array]:
        """Admission and prompt processing: prefill, the first token, the head primed."""
        check_prompt(self.model, prompt.tolist())
        self._resolve()
        self.steps.reconcile()  # a start the gate disabled begins suspended
        logits, hiddens = prefill_with_hidden(
            self.model, prompt, self.cache, self.prefill_step_size, after_chunk=self._quantize
        )
        window_kv.adopt(self.cache)  # sliding windows roll back exactly from here on
        layer_kv.adopt(self.cache, self.model)  # so do DeepSeek-V4.1's layer caches
        prompt_tokens = prompt.tolist()
        logprobs = self._process(logits, prompt_tokens)
        first = mx.argmax(logprobs, axis=-1) if self.sampler is None else self.sampler(logprobs)
        y = int(self.engine.agreed(first).item())  # rank 0's draw under mx.distributed
        row = RowHead()
        disabled = getattr(self.controller, "disabled", False)  # never speculates: no head work
        if self.head is not None and self.refusal is None and not disabled:
            pairs = [*prompt_tokens[1:], y]
            score = getattr(self.controller, "prices_prompts", False)
            row = self.engine.prime(
                self.head_cache, hiddens, pairs, self.params, self.prefill_step_size, score
            )
            if row.prompt_acceptance is not None:
                # a sampled start: the prompt's acceptance at its settings, not the greedy prior
                self.controller.price_prompts(float(row.prompt_acceptance.item()), 1)
                self.steps.reconcile()
            if self.controller is None or self.controller.speculating:
                # the head's pass over the prompt is prompt processing (the batch path's
                # rows are primed the same way): before the first token, not in the first
                # cycle. A start the controller suspends leaves it lazy: the first
                # speculative probe, if one comes, evaluates it.
                mx.eval(row.draft, row.hidden, [c.state for c in self.head_cache])
        self.engine.extend(mx.array([y]), [row])
        if self.processors:
            self._history = TokenHistory([*prompt_tokens, y])  # everything before y, then y
        if row.draft is not None:
            self._enter_batch_form()
        return y, logprobs[-1]

    def _enter_batch_form(self) -> None:
        """Run the cycles on one-row batch caches, whose rollback runs in the graph.

        Only where merging gives an exact one-row twin: plain KV, (captured) recurrent
        layers and windows without a kept prefix, no processors, no quantized KV.
        Anything else stays in its own form and rolls back after each sync.
        """
        cache, head_cache = self.engine.cache, self.engine.head_cache
        if not self.run_ahead or self.processors or self.kv_bits is not None:
            return

        def window(c: Any) -> bool:
            return type(c) is window_kv.WindowedKVCache and c.keep == 0

        if not all(type(c) in (KVCache, ArraysCache) or window(c) for c in cache):
            return
        if not all(type(c) is KVCache or window(c) for c in head_cache):
            return
        self._single_form = cache
        self.engine.cache = batch_caches.adopt(_merge_caches([cache]))
        self.engine.head_cache = batch_caches.adopt(_merge_caches([head_cache]))

    def _leave_batch_form(self) -> None:
        """Hand the caches back in mlx-lm's single-sequence form, in the caller's list."""
        if self._single_form is None:
            return
        single, self._single_form = self._single_form, None
        for i, c in enumerate(self.engine.cache):
            single[i] = c.extract(0)
        self.engine.cache = single
        self.engine.head_cache = [window_kv.single_head(c.extract(0)) for c in self.engine.head_cache]

    def _process(self, logits: mx.array, prompt: list[int]) -> mx.array:
        """Processed log-probabilities [1, V] of the prefill's last logits."""
        if self.processors:
            history = mx.array(prompt)
            for processor in self.processors:
                logits = processor(history, logits)
        return normalize_logits(logits)

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
