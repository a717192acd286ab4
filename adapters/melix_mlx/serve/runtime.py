"""mlx-lm's server generation loop, with MTPBatchGenerator as its batch generator.

Rules of this module:
- No second serving loop: `ServingResponseGenerator` runs mlx-lm's own
  `ResponseGenerator._generate`, `_serve_single` and `generate` code objects, rebound
  (`rebind`) to a copy of their module scope in which a few factory names are ours:
  `BatchGenerator` builds a `ServingBatchGenerator`, `GenerationContext` builds a
  `SpeculativeContext` (the request context that also carries the request's response
  queue and its speculative usage). mlx-lm's module is never modified, so its own
  server keeps working in the same process. `rebind` fails loudly if mlx-lm's code no
  longer names a factory we substitute.
- One generation thread, fed by a bounded queue (`submit`; `queue.Full` when it is
  full). Each request's responses go to an `AsyncResponseQueue`
  (melix_mlx.serve.request_queue): the generation thread puts, the HTTP event loop
  reads, and no HTTP thread ever blocks on a request.
- Before a request is prefilled (`_tokenize`): a request cancelled while it waited is
  dropped; its tokens were made on the HTTP side (melix_mlx.serve.prompt_work), else
  here, where an empty or too long prompt is refused (`PromptRejected`, a 400).
- Fair prefill (melix_mlx.serve.chunks, prompt_work): each step prefills what its time
  budget allows (`PrefillBudget`; ranks cut fixed chunks) between the decode steps;
  only real segment boundaries are reported to mlx-lm's loop as such; a step in which a
  short prompt joins skips the segment stage, every other step at most
  (`BudgetedPrefill`); each step's prefill time goes to /metrics.
- Cancellation in any state: a stopped context's row leaves at its next response (mlx-lm's
  loop); a stopped request still waiting in the generator's queue is removed there
  (`remove`) and given a progress response, so the loop forgets it.
- Every request joins the batch, a seeded one with its own random stream (its sampler and
  processors: melix_mlx.serve.seeded). Only a model whose caches cannot be batched runs
  mlx-lm's plain path, without MTP, and its usage says so; that path sees the prompt
  cache through `PartialHits` (a full hit leaves one token).
- A request's context is bound to its batch uid when mlx-lm inserts it (the context is
  built just before, in the same generation thread). A finishing row writes its
  speculative usage into the context before mlx-lm queues its last response, so the
  HTTP side finds it on the context when the response ends.
- A turn of mlx-lm's loop is one generator step (`_time_budget`): a request that arrives
  while the batch decodes is inserted before the next step, not after mlx-lm's 0.5 s of
  steps. Sharded servers keep their own turn (melix_mlx.serve.ranks).
- Each turn of the loop (busy or idle) the generation thread may return malloc's free
  pages to the system (melix_mlx.serve.memory.MemoryTrim, every `memory_trim_s`).
- If mlx-lm's loop itself raises (it would die, and the server with it), the requests it
  held get the exception, its batch generator is closed, and a fresh loop serves on.
- Failures stay with their request: an insertion that raises fails its request only; each
  row's logits processors are guarded, so one that raises records the failure and the
  batched step completes for the other rows; a request whose prefill raises is dropped
  (melix_mlx.decoding.batch_surface). After the step the failed rows leave the batch,
  their exception goes to their response queue (a 500) and a progress response lets
  mlx-lm's loop forget them; an exception of the batched step itself ends its rows so.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable
from queue import Queue
from typing import Any

import mlx_lm.server as server_module
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.server import ResponseGenerator

from ..decoding.batch_generator import MTPBatchGenerator
from .chunks import split_segments
from .images import image_safe, no_image_parts, row_caches
from .memory import MemoryTrim
from .plain_path import PartialHits
from .prompt_work import BudgetedPrefill, PrefillBudget, tokenize
from .request_queue import AsyncResponseQueue, RequestCancelled, SpeculativeContext
from .seeded import row_processors, row_sampler
from .usage import PLAIN_PATH_REASON, speculative_usage


def rebind(function: Any, **names: Any) -> Any:
    """`function`'s code over a copy of its globals with `names` replaced."""
    missing = sorted(n for n in names if n not in function.__code__.co_names)
    if missing:
        raise RuntimeError(f"{function.__module__}.{function.__qualname__} no longer uses {missing}")
    scope = dict(function.__globals__)
    scope.update(names)
    return types.FunctionType(
        function.__code__, scope, function.__name__, function.__defaults__, function.__closure__
    )


class ServingBatchGenerator(BudgetedPrefill, MTPBatchGenerator):
    """MTPBatchGenerator plus the server's bookkeeping: contexts, usage, metrics, failures."""

    def __init__(
        self,
        *args: Any,
        contexts: dict[int, Any],
        pending: list,
        metrics: Any,
        method: str = "mtp",
        prefill_chunk: int = 256,
        prefill_budget_s: float | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.prefill_chunk = prefill_chunk
        self.budget = PrefillBudget(prefill_budget_s, prefill_chunk)
        self._boundaries: dict[int, set[int]] = {}  # uid -> real segment ends (see chunks)
        self.method = method  # what fills the head slot: "mtp" or "draft_model"
        self.contexts = contexts  # uid -> SpeculativeContext
        self._pending = pending  # the context mlx-lm built for the next insert
        self.metrics = metrics
        self._failed: dict[int, BaseException] = {}
        # sharded serving (melix_mlx.serve.ranks): the cancellations every rank has agreed
        # on (None: read each context's own flag), a batched step's error ends the server,
        # and each finished step tells the rank's watchdog that its collectives returned
        self.committed: set[int] | None = None
        self.fatal_errors = False
        self.heartbeat: Callable[[], None] | None = None
        self._returned: float | None = None  # when the last step returned with work left

    def insert_segments(self, segments: list, *args: Any, **kwargs: Any) -> list[int]:
        first = self.next_uid
        whole = segments  # before the cut: a VL row's prompt and images (melix_mlx.serve.images)
        held = kwargs.get("all_tokens") or [[] for _ in segments]
        given = kwargs.get("caches") or [None for _ in segments]
        # the piece prefilled when the row joins (re-cut at each step); a fresh prompt's is priced by joins
        lasts = [self.budget.piece(fresh=not h and c is None) for h, c in zip(held, given)]
        chunk = self.prefill_chunk
        cut = [split_segments(seq, len(h), chunk, last) for seq, h, last in zip(segments, held, lasts)]
        segments = [pieces if pieces else seq for (pieces, _), seq in zip(cut, segments)]
        processors = kwargs.get("logits_processors")
        if processors:
            kwargs["logits_processors"] = [
                [self._guard(first + i, p) for p in row] if row else row for i, row in enumerate(processors)
            ]
        try:
            kwargs["caches"] = row_caches(self.model, whole, kwargs.get("caches"))
            uids = super().insert_segments(segments, *args, **kwargs)
        except Exception as exc:  # mlx-lm's loop would die of it: the request fails alone
            uids = [self.reserve_uid()]
            self._failed[uids[0]] = exc
        ctx = self._pending.pop() if self._pending else None
        for uid, (_, boundaries) in zip(uids, cut):
            self._boundaries[uid] = boundaries
            if ctx is not None:
                self.contexts[uid] = ctx
        return uids

    def _guard(self, uid: int, processor: Any) -> Any:
        def guarded(tokens: Any, logits: Any) -> Any:
            try:
                return processor(tokens, logits)
            except Exception as exc:  # this row fails; the batched step goes on
                self._failed.setdefault(uid, exc)
                return logits

        return guarded

    def on_failures(self, failures: dict[int, BaseException], responses: tuple[list, list]) -> None:
        self._failed.update(failures)

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> dict[int, Any]:
        out = super().remove(uids, return_prompt_caches)
        for uid in uids:
            self.contexts.pop(uid, None)
            self._boundaries.pop(uid, None)
            if self.committed is not None:
                self.committed.discard(uid)
        self.metrics.forget(uids)
        self.metrics.observe_rows(self.batch.rows)
        return out

    def _drop_cancelled(self) -> list[PromptProcessingBatch.Response]:
        """Requests stopped while waiting for a row leave the queue (see the module rules)."""
        contexts = self.contexts.items()
        waiting = [u for u, ctx in contexts if self._stopped(u, ctx) and u not in self.batch]
        if waiting:
            self.remove(waiting)
        return [PromptProcessingBatch.Response(uid, (0, 0), False, False) for uid in waiting]

    def _stopped(self, uid: int, ctx: Any) -> bool:
        return uid in self.committed if self.committed is not None else getattr(ctx, "cancelled", False)

    def _segment_ends(self, responses: list) -> list:
        """Chunk ends are progress, not segment ends: only real ones store a prefix."""
        out = []
        for r in responses:
            real = r.progress[0] in self._boundaries.get(r.uid, ())
            if r.end_of_segment and not r.end_of_prompt and not real:
                r = PromptProcessingBatch.Response(r.uid, r.progress, False, False)
            out.append(r)
        return out

    def next(self) -> tuple[list, list]:
        started = time.perf_counter()
        if self._returned is not None:  # the loop's work since the last step, while rows were busy
            self.metrics.between_steps.observe(started - self._returned)
        prompt_before = self.prompt_tokens
        dropped = self._drop_cancelled()
        try:
            prompt_responses, generation = super().next()
            prompt_responses = dropped + self._segment_ends(prompt_responses)
        except Exception as exc:  # the batched step itself failed: its rows end with it
            if self.fatal_errors:  # sharded: a peer may be gone; the ranks can no longer agree
                raise
            prompt_responses, generation = dropped, []
            self._abandon_batch(exc)
        failed = self._failed
        self._failed = {}
        if failed:
            generation = [r for r in generation if r.uid not in failed]
            prompt_responses = [r for r in prompt_responses if r.uid not in failed]
            prompt_responses += self._end_with_errors(failed)  # before remove() forgets contexts
            self.remove([uid for uid in failed if uid in self.batch])
        for r in generation:
            if r.finish_reason is not None and r.uid in self.contexts:
                self._boundaries.pop(r.uid, None)
                ctx = self.contexts.pop(r.uid)
                ctx.speculative = speculative_usage(r.stats, self.refusal, self.method)
        self.metrics.observe_step(
            self.last_report, len(generation), self.prompt_tokens - prompt_before, self.batch.rows
        )
        if self.heartbeat is not None:
            self.heartbeat()
        self._returned = time.perf_counter() if len(self.batch) or self._queue else None
        self.metrics.steps.observe((self._returned or time.perf_counter()) - started)
        return prompt_responses, generation

    def _abandon_batch(self, exc: BaseException) -> None:
        for uid in self.end_all(f"error: {exc}"):
            self._failed.setdefault(uid, exc)

    def _end_with_errors(self, failed: dict[int, BaseException]) -> list[PromptProcessingBatch.Response]:
        """Hand each failed request its exception; a progress response makes mlx-lm drop it."""
        out = []
        for uid, exc in failed.items():
            ctx = self.contexts.pop(uid, None)
            if ctx is None:
                continue
            ctx.stop()
            if ctx.queue is not None:
                ctx.queue.put(exc)
            out.append(PromptProcessingBatch.Response(uid, (0, 0), False, False))
            self.metrics.failures.inc()
        return out


class ServingResponseGenerator(ResponseGenerator):
    """mlx-lm's ResponseGenerator with our batch generator and contexts; see the rules."""

    ranks = 1  # the processes the model is sharded over (melix_mlx.serve.ranks)

    def __init__(
        self,
        model_provider: Any,
        prompt_cache: Any,
        metrics: Any,
        *,
        queue_size: int = 0,
        prefill_chunk: int = 256,
        prefill_budget_s: float | None = None,
        memory_trim_s: float = 0.0,
    ) -> None:
        self.served = model_provider.served
        self.metrics = metrics
        self.memory_trim = MemoryTrim(memory_trim_s)  # ticked by the generation thread
        metrics.registry.register(self.memory_trim)
        self.queue_size = queue_size  # 0: unbounded (the HTTP side bounds it too)
        self.prefill_chunk = prefill_chunk
        self.prefill_budget_s = prefill_budget_s
        self.contexts: dict[int, SpeculativeContext] = {}
        self._pending: list[SpeculativeContext] = []
        self.batch_generator: ServingBatchGenerator | None = None  # the latest one built
        self._loop = rebind(ResponseGenerator._generate, **self.substitutions())
        self._single = rebind(ResponseGenerator._serve_single, GenerationContext=self._plain_context)
        prompt_cache = image_safe(prompt_cache, self.served)  # image tokens never key it (serve.images)
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    @property
    def _time_budget(self) -> Any:
        """One generator step per turn of mlx-lm's loop: the loop takes new requests only
        between turns, and mlx-lm's turn (its `TimeBudget`: steps for 0.5 s) held a request
        that arrived meanwhile for up to that long (measured beside a 20k-token prefill:
        median TTFT 0.45 s for 0.04 s idle). A turn without a request costs one `get_nowait`."""
        return range(1)

    @_time_budget.setter
    def _time_budget(self, _: Any) -> None:  # mlx-lm's __init__ assigns its TimeBudget
        pass

    @property
    def requests(self) -> Queue:
        return self._requests

    @requests.setter
    def requests(self, _: Queue) -> None:  # mlx-lm's __init__ assigns an unbounded one
        self._requests = Queue(maxsize=self.queue_size)

    def submit(self, rqueue: AsyncResponseQueue, request: Any, args: Any) -> None:
        """Queue a request for the generation thread (`queue.Full` when the queue is full)."""
        if not self.generation_available():
            raise RuntimeError("generation thread died")
        self.requests.put_nowait((rqueue, request, args))

    def stop(self, timeout: float) -> None:
        """Stop the generation thread and wait for it (bounded)."""
        self._stop = True
        self._generation_thread.join(timeout)

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        cancelled = getattr(request, "cancelled", None)
        if cancelled is not None and cancelled.is_set():
            raise RequestCancelled("cancelled while queued")
        given = getattr(request, "tokenized", None)
        return given if given is not None else tokenize(self, tokenizer, request, args)

    def substitutions(self) -> dict[str, Any]:
        """Names replaced in mlx-lm's generation loop (a subclass may add more)."""
        return {
            "BatchGenerator": self._make_batch_generator,
            "GenerationContext": self._batched_context,
            "_image_parts": no_image_parts,  # images were tokenized on the HTTP side: they batch
            "_make_sampler": row_sampler(server_module._make_sampler),
            "_make_logits_processors": row_processors(server_module._make_logits_processors),
        }

    def _is_batchable(self, args: Any) -> bool:
        """A seed no longer takes a request out of the batch (melix_mlx.serve.seeded)."""
        return self.model_provider.is_batchable and self.cli_args.kv_bits is None

    def _generate(self) -> None:
        while not self._stop:
            try:
                self._loop(self)
                return
            except Exception as exc:  # mlx-lm's loop died: its requests fail, a fresh loop serves on
                logging.exception("the generation loop failed; its requests fail and it restarts")
                self._fail_in_flight(exc)

    def _next_request(self, timeout: float | None = None) -> Any:
        self.memory_trim.tick()  # each turn of the loop, busy or idle
        request = super()._next_request(timeout)
        if request is not None:
            self._taken = request[0]  # the response queue of the request the loop works on
        return request

    def _fail_in_flight(self, exc: BaseException) -> None:
        """Every request the dead loop held gets `exc`; its batch generator is closed."""
        queues = [ctx.queue for ctx in self.contexts.values() if ctx.queue is not None]
        taken = getattr(self, "_taken", None)
        if taken is not None and getattr(taken, "ctx", None) is None:
            queues.append(taken)
        for rqueue in dict.fromkeys(queues):
            rqueue.put(exc)
        self.contexts.clear()
        self._pending.clear()
        if self.batch_generator is not None:
            with contextlib.suppress(Exception):
                self.batch_generator.close()
            self.batch_generator = None

    def _serve_single(self, request: Any, stream: Any) -> None:
        shared = self.prompt_cache  # only the generation thread reads it: swapped for this call
        self.prompt_cache = PartialHits(shared)
        try:
            self._single(self, request, stream)
        finally:
            self.prompt_cache = shared

    def _batched_context(self, **fields: Any) -> SpeculativeContext:
        ctx = SpeculativeContext(**fields)
        self._pending[:] = [ctx]
        return ctx

    def _plain_context(self, **fields: Any) -> SpeculativeContext:
        return SpeculativeContext(**fields, speculative={"method": "none", "reason": PLAIN_PATH_REASON})

    def _make_batch_generator(self, model: Any, **options: Any) -> ServingBatchGenerator:
        served = self.served
        self.batch_generator = ServingBatchGenerator(
            model,
            served.head,
            num_draft_tokens=served.num_draft_tokens,
            refusal=served.refusal,
            controller=served.controller,
            contexts=self.contexts,
            pending=self._pending,
            metrics=self.metrics,
            method=served.requested_method,
            objective="throughput",  # requests keep arriving: every emitted token counts
            prefill_chunk=self.prefill_chunk,
            prefill_budget_s=self.prefill_budget_s,
            **options,
        )
        return self.batch_generator
