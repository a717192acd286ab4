"""One accepted request on the event loop: its machine, its responses, its end.

Rules of this module:
- A `Submission` owns one request tracker (melix_fsm.request, spec/request.toml) and
  sends it every event of the request's life, from what the generation thread puts on
  the request's queue: the first prompt progress starts its prefill (`start_prefill`),
  each further one is a `prefill_chunk`, the first token is `first_token`, the others
  `token`, the end marker `complete`; an exception is a `fault`. The server's own ends
  go through `abort`: `cancel` (client gone, deadline), `drain` (not started when the
  server began to drain), `drain_timeout`. A final state is reached exactly once;
  whatever arrives after it is ignored.
- `abort` stops the request in the generation thread wherever it is (queued, prefilling,
  generating: melix_mlx.serve.request_queue.AsyncResponseQueue.cancel) and wakes the reader
  with an `Aborted` marker, so a handler waiting on a long prefill answers at once.
- Every wait is bounded by the request's deadline (`request_timeout_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from mlx_lm.server import Response

from melix_fsm.errors import MelixError
from melix_fsm.request import RequestEvent, RequestState, new_request

from .prompt_work import PromptRejected
from .protocol import Parsed
from .request_queue import AsyncResponseQueue, RequestCancelled, SpeculativeContext

FAULT_TYPES = (ValueError, TypeError, KeyError, IndexError)  # bad input found while tokenizing


class Aborted(MelixError):
    """The server ended the request (`event`): its client, its deadline or a drain."""

    def __init__(self, event: RequestEvent, reason: str) -> None:
        super().__init__(reason)
        self.event = event
        self.reason = reason


class Submission:
    def __init__(self, parsed: Parsed, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.parsed = parsed
        self.tracker = new_request()
        self.queue = AsyncResponseQueue(loop, parsed.request.cancelled)
        self.ctx: SpeculativeContext | None = None
        self.deadline = time.monotonic() + timeout_s
        self.end_reason = ""
        self.end_event: RequestEvent | None = None  # the event that ended the request

    @property
    def state(self) -> RequestState:
        return self.tracker.state

    def _send(self, event: RequestEvent, reason: str = "") -> None:
        if not self.tracker.is_final and self.tracker.allows(event):
            self.tracker.send(event, reason)
            if self.tracker.is_final:
                self.end_reason, self.end_event = reason, event

    def abort(self, event: RequestEvent, reason: str) -> bool:
        """End the request from the server's side; False when it had already ended."""
        if self.tracker.is_final or not self.tracker.allows(event):
            return False
        self._send(event, reason)
        self.queue.cancel()
        self.queue.items.put_nowait(Aborted(event, reason))
        return True

    async def _next(self) -> Any:
        remaining = self.deadline - time.monotonic()
        try:
            item = await asyncio.wait_for(self.queue.items.get(), max(remaining, 0.0))
        except TimeoutError:
            self.abort(RequestEvent.cancel, "the request timed out")
            item = await self.queue.items.get()  # the marker abort just put (or an earlier item)
        if isinstance(item, Aborted):
            raise item
        if self.tracker.is_final:  # aborted: a late item of the generation thread, queued
            # before the abort's marker: end as the abort said (a drain timeout stays one)
            raise Aborted(self.end_event or RequestEvent.cancel, self.end_reason or "ended")
        if isinstance(item, BaseException):
            self._send(RequestEvent.fault, f"{type(item).__name__}: {item}")
            raise item
        return item

    async def context(self) -> SpeculativeContext:
        """Wait until the generation thread took the request (its context)."""
        while True:
            item = await self._next()
            if isinstance(item, SpeculativeContext):
                self.ctx = item
                return item
            logging.debug("an item before the context: %r", item)

    async def responses(self) -> AsyncIterator[Response | tuple]:
        """The request's generated responses (and prefill progress, as tuples), to its end."""
        while True:
            item = await self._next()
            if item is None:
                if not self.tracker.allows(RequestEvent.complete):
                    self._send(RequestEvent.fault, "ended before generating")
                    raise RuntimeError("the request ended before generating a token")
                self._send(RequestEvent.complete)
                return
            if isinstance(item, tuple):
                self._send(
                    RequestEvent.start_prefill
                    if self.state is RequestState.queued
                    else RequestEvent.prefill_chunk
                )
                yield item
                continue
            if self.state is RequestState.queued:
                self._send(RequestEvent.start_prefill)
            first = self.state is RequestState.prefilling
            self._send(RequestEvent.first_token if first else RequestEvent.token)
            yield item


def is_bad_input(exc: BaseException) -> bool:
    """An exception before the context came from the request itself (a 400), not the server."""
    return isinstance(exc, (PromptRejected, RequestCancelled, *FAULT_TYPES)) or type(exc).__name__ in (
        "TemplateError",
        "TemplateSyntaxError",
        "UndefinedError",
        "InvalidPrompt",
    )
