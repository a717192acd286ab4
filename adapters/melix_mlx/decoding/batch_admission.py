"""Admission for the batched generator: requests in, prefilled rows into the generation batch.

mlx-lm's BatchGenerator keeps prompt processing apart from its generation batch; this
is that half of `MTPBatchGenerator` (melix_mlx.batch_generator), as a mixin: `insert`
queues requests; each `next()` admits queued requests to free rows (`_admit`).

Rules of this module:
- Joining rows are prefilled (melix_mlx.decoding.batch_prompts: together where nothing of them
  is cached yet, as mlx-lm prefills its prompts; this also primes their head caches),
  resolved (admit or refuse: a lifecycle event each), appended to the caches and the
  engine with `extend`, steered to the batch-wide verdict of the live policy, and their
  first token (drawn from the prefill) is emitted at once, counted as generated as
  mlx-lm's generator counts it.
- Rows join only while no step runs ahead: a step built for the rows as they were cannot
  be undone across a reshape (a row left on a stop token while it was built), so rows
  join one call later.
- A request whose prefill raises fails alone (melix_mlx.decoding.batch_surface): if a joint
  prefill raises, the group's rows not yet ready are prefilled one by one (the same
  tokens either way), so only the one that fails on its own leaves, and a row made ready
  before the failure keeps its first token (its sampler is not run twice).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch, StopSequences, _extend_cache, _merge_caches

from melix_fsm import lifecycle as lc
from melix_fsm.batch import Batch, Operation
from melix_fsm.lifecycle import Signal

from ..runtime import batch_caches
from ..runtime.prefill import check_prompt
from .batch_prompts import PreparedRow, join_groups, joins_fresh, prepare_row, prepare_rows
from .batch_rows import InsertRequest, MTPResponse, RowState


class BatchAdmission:
    """Mixin: the admission half of MTPBatchGenerator; see the module rules."""

    # provided by MTPBatchGenerator (and BatchSurface)
    model: Any
    head: Any
    engine: Any
    steps: Any
    batch: Batch
    refusal: str | None
    controller: Any
    max_tokens: int
    sampler: Any
    logits_processors: list[Any]
    num_draft_tokens: int
    prefill_batch_size: int
    completion_batch_size: int
    prefill_step_size: int
    max_kv_size: int | None
    _queue: Any
    _uid_count: int
    _counters: Any
    _default_stop: StopSequences
    _max_padding: float
    _joined: list[Any]
    _pop_ready: Callable[[int], list[InsertRequest]]
    _fail: Callable[[InsertRequest, BaseException], None]
    _apply_signals: Callable[..., None]
    _emit: Callable[..., str | None]
    _finish: Callable[[list[Any], list[MTPResponse]], None]

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
        """Queue requests (mlx-lm's `insert`, plus a draft count per request); their uids."""
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

    def _admit(self, out: list[MTPResponse]) -> list[PromptProcessingBatch.Response]:
        """Admit queued requests to free rows; their first tokens go to `out`."""
        if self.steps.ahead is not None:
            return []  # rows join one call later (see the module rules)
        ready = self._pop_ready(min(self.prefill_batch_size, self.completion_batch_size - len(self.batch)))
        joining = Batch()
        caches, head_caches, heads, ys, responses = [], [], [], [], []
        tic = time.perf_counter()
        for request, prepared in self._prepare(ready):
            row = prepared.state
            joining.extend([request.uid], payloads=[row])
            resolution = (
                lc.ADMIT if row.refusal is None else Signal(event=lc.REFUSE.event, reason=row.refusal)
            )
            self._apply_signals(Operation.resolve, {request.uid: resolution}, joining)
            self._joined.append(request.uid)
            caches.append(prepared.cache)
            head_caches.append(prepared.head_cache)
            heads.append(prepared.head)
            ys.append((row.y, prepared.first_logprobs))
            self._counters.prompt_tokens += len(request.prompt)
            total = len(request.all_tokens) + len(request.prompt)
            responses.append(PromptProcessingBatch.Response(request.uid, (total, total), True, True))
        self._counters.prompt_time += time.perf_counter() - tic
        if ys:
            self._join(joining, caches, head_caches, heads, ys, out)
        return responses

    def _join(
        self,
        joining: Batch,
        caches: list[list[Any]],
        head_caches: list[list[Any]],
        heads: list[Any],
        firsts: list[tuple[int, mx.array]],
        out: list[MTPResponse],
    ) -> None:
        """Append prefilled rows to the caches, the engine and the batch; emit their first tokens."""
        engine = self.engine
        engine.cache = _extend_cache(engine.cache, batch_caches.adopt(_merge_caches(caches)))
        if self.head is not None:
            engine.head_cache = _extend_cache(
                engine.head_cache, batch_caches.adopt(_merge_caches(head_caches))
            )
        engine.extend(mx.array([y for y, _ in firsts], dtype=mx.uint32), heads)
        first = len(self.batch)
        self.batch.extend(joining)
        joined = self.batch.rows[first:]
        self._price_prompts()
        # joining rows follow the batch-wide verdict
        self.steps.reconcile([row.uid for row in joined], [row.state for row in joined])
        self._counters.generation_tokens += len(joined)
        finished = []
        for row, (_, logprobs) in zip(joined, firsts):
            state: RowState = row.payload
            if self._emit(row.uid, state, state.y, logprobs, False, out):
                finished.append(row.uid)
        if finished:
            self._finish(finished, out)

    def _price_prompts(self) -> None:
        """Before the first step, a batch with sampled rows is priced at the acceptance
        their prompts scored (melix_mlx.runtime.prompt_score); greedy rows count at the
        family prior, refused rows not at all (LiveController.price_prompts)."""
        if not getattr(self.controller, "prices_prompts", False):
            return
        rows = [
            (head.prompt_acceptance, row.payload.refusal)
            for head, row in zip(self.engine.rows, self.batch.rows)
        ]
        if all(score is None for score, _ in rows):
            return
        prior = self.controller.prior.acceptance
        rates = [prior if s is None else float(s.item()) for s, refusal in rows if refusal is None]
        if rates:
            self.controller.price_prompts(sum(rates) / len(rates), len(self.batch))

    def _prepare(self, ready: list[InsertRequest]) -> list[tuple[InsertRequest, PreparedRow]]:
        """Prefill the joining requests, in order: those with nothing cached together in
        groups of similar length (`join_groups`; all in one group where caches are
        windowed, as mlx-lm joins them), the rest alone; a failure stays its request's."""
        options: dict[str, Any] = dict(
            refusal=self.refusal,
            head_disabled=getattr(self.controller, "disabled", False),
            score_prompts=getattr(self.controller, "prices_prompts", False),
            max_kv_size=self.max_kv_size,
            prefill_step_size=self.prefill_step_size,
        )
        done: dict[int, PreparedRow] = {}
        for group in join_groups([r for r in ready if joins_fresh(r)], self._max_padding):
            if len(group) > 1:
                with contextlib.suppress(Exception):  # the rows not yet ready go one by one below
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
