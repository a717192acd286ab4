"""mlx-lm's server generation loop, with MTPBatchGenerator as its batch generator.

Rules of this module:
- No second serving loop: `ServingResponseGenerator` runs mlx-lm's own
  `ResponseGenerator._generate`, `_serve_single` and `generate` code objects, rebound
  (`rebind`) to a copy of their module scope in which a few factory names are ours:
  `BatchGenerator` builds a `ServingBatchGenerator`, `GenerationContext` builds a
  `SpeculativeContext` (the request context that also carries the request's response
  queue and its speculative usage), `Queue` builds a `RequestQueue`. mlx-lm's module is
  never modified, so its own server keeps working in the same process. `rebind` fails
  loudly if mlx-lm's code no longer names a factory we substitute.
- Requests mlx-lm's server does not batch (a request with a seed) run on its plain
  single-sequence path without MTP; their usage says so (method "none" and the reason).
- A request's context is bound to its batch uid when mlx-lm inserts it (the context is
  built just before, in the same generation thread). A finishing row writes its
  speculative usage into the context before mlx-lm queues its last response, so the
  HTTP handler finds it when the response ends (`current_context`).
- Failures stay with their request: an insertion that raises fails its request only; each
  row's logits processors are guarded, so one that
  raises records the failure and the batched step completes for the other rows; a
  request whose prefill raises is dropped by the generator (melix_mlx.batch_surface).
  After the step the failed rows leave the batch, their exception goes to their response
  queue (the handler answers 500) and a progress response lets mlx-lm's loop forget them.
  An exception of the batched step itself ends the rows in that step the same way; the
  queue and the server go on.
"""

from __future__ import annotations

import contextlib
import threading
import types
from dataclasses import dataclass
from queue import Queue
from typing import Any

from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.server import GenerationContext, ResponseGenerator

from melix_fsm import lifecycle as lc
from melix_fsm.lifecycle import Signal

from ..batch_generator import MTPBatchGenerator
from .usage import PLAIN_PATH_REASON, speculative_usage

_local = threading.local()


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


@dataclass
class SpeculativeContext(GenerationContext):
    queue: Any = None  # the request's response queue (set when mlx-lm queues the context)
    speculative: dict[str, Any] | None = None  # the usage's speculative object, once finished


class RequestQueue(Queue):
    """A response queue that tells the request's context where its responses go."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, SpeculativeContext):
            item.queue = self
        super().put(item, block, timeout)


def current_context() -> SpeculativeContext | None:
    """The context of the request this (HTTP handler) thread generated last."""
    return getattr(_local, "ctx", None)


class ServingBatchGenerator(MTPBatchGenerator):
    """MTPBatchGenerator plus the server's bookkeeping: contexts, usage, metrics, failures."""

    def __init__(
        self,
        *args: Any,
        contexts: dict[int, Any],
        pending: list,
        metrics: Any,
        method: str = "mtp",
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.method = method  # what fills the head slot: "mtp" or "draft_model"
        self.contexts = contexts  # uid -> SpeculativeContext
        self._pending = pending  # the context mlx-lm built for the next insert
        self.metrics = metrics
        self._failed: dict[int, BaseException] = {}

    def insert_segments(self, segments: list, *args: Any, **kwargs: Any) -> list[int]:
        first = self._uid_count
        processors = kwargs.get("logits_processors")
        if processors:
            kwargs["logits_processors"] = [
                [self._guard(first + i, p) for p in row] if row else row for i, row in enumerate(processors)
            ]
        try:
            uids = super().insert_segments(segments, *args, **kwargs)
        except Exception as exc:  # mlx-lm's loop would die of it: the request fails alone
            uids = [self._uid_count]
            self._uid_count += 1
            self._failed[uids[0]] = exc
        ctx = self._pending.pop() if self._pending else None
        if ctx is not None:
            for uid in uids:
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
        self.metrics.observe_rows(self.batch.rows)
        return out

    def next(self) -> tuple[list, list]:
        prompt_before = self._counters.prompt_tokens
        try:
            prompt_responses, generation = super().next()
        except Exception as exc:  # the batched step itself failed: its rows end with it
            prompt_responses, generation = [], []
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
                ctx = self.contexts.pop(r.uid)
                ctx.speculative = speculative_usage(r.stats, self.refusal, self.method)
        self.metrics.observe_step(
            self.last_report, len(generation), self._counters.prompt_tokens - prompt_before, self.batch.rows
        )
        return prompt_responses, generation

    def _abandon_batch(self, exc: BaseException) -> None:
        uids = list(self.batch.uids)
        with contextlib.suppress(Exception):  # rows may be mid-cycle; they leave regardless
            ended = Signal(event=lc.FINISH.event, reason=f"error: {exc}")
            self._apply_signals("finish", {uid: ended for uid in uids})
        if self._ahead is not None:  # a step launched ahead is undone before the rows go
            with contextlib.suppress(RuntimeError):
                self.engine.abandon(self._ahead)
        self._ahead = None
        self._filter([])
        for uid in uids:
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

    def __init__(self, model_provider: Any, prompt_cache: Any, metrics: Any) -> None:
        self.served = model_provider.served
        self.metrics = metrics
        self.contexts: dict[int, SpeculativeContext] = {}
        self._pending: list[SpeculativeContext] = []
        self.batch_generator: ServingBatchGenerator | None = None  # the latest one built
        self._loop = rebind(ResponseGenerator._generate, **self.substitutions())
        self._single = rebind(ResponseGenerator._serve_single, GenerationContext=self._plain_context)
        self._submit = rebind(ResponseGenerator.generate, Queue=RequestQueue)
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    def substitutions(self) -> dict[str, Any]:
        """Names replaced in mlx-lm's generation loop (a subclass may add more)."""
        return {"BatchGenerator": self._make_batch_generator, "GenerationContext": self._batched_context}

    def _generate(self) -> None:
        self._loop(self)

    def _serve_single(self, request: Any, stream: Any) -> None:
        self._single(self, request, stream)

    def generate(self, request: Any, generation_args: Any, progress_callback: Any = None) -> Any:
        ctx, responses = self._submit(self, request, generation_args, progress_callback)
        _local.ctx = ctx
        return ctx, responses

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
            **options,
        )
        return self.batch_generator
