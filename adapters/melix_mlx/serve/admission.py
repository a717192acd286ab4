"""Which requests the server takes, and its drain.

Rules of this module:
- `Admission` counts the accepted requests that have not ended. At most `capacity`
  (the batch's rows plus `max_queue`) are in flight; one more is refused with 429 and
  `Retry-After`, before anything is queued. While draining, new requests get 503.
- `drain(timeout)`: requests still queued fail at once (`drain`: their clients get 503);
  started ones may finish until the timeout, then each is ended (`drain_timeout`): a
  stream ends with an error event and a finish reason, a plain request gets 503.
  `drained` is set when no request is left.
- A sharded server that lost a rank (`fail_all`) ends every open request with
  `rank_lost` (503, or an error event in a stream) and refuses new ones with 503.
- Each ended request is counted by its final state (`melix_requests_total{state}`).
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any

from melix_fsm.request import RequestEvent, RequestState

from .errors import ApiError
from .session import Submission

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, generator: Any, metrics: Any, capacity: int) -> None:
        self.generator = generator
        self.metrics = metrics
        self.capacity = capacity
        self.live: set[Submission] = set()
        self.draining = False
        self.lost: str | None = None  # a sharded server lost a rank: nothing more is served
        self.drained = asyncio.Event()

    def admit(self, sub: Submission) -> None:
        """Queue `sub` for the generation thread, or refuse it (ApiError 429/503)."""
        if self.lost is not None:
            raise ApiError(503, self.lost, code=RequestEvent.rank_lost.value)
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="draining")
        if not self.generator.generation_available():
            raise ApiError(503, "the generation thread is not running", code="unavailable")
        if len(self.live) >= self.capacity:
            raise ApiError(
                429,
                "too many requests in flight; retry later",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        try:
            self.generator.submit(sub.queue, sub.parsed.request, sub.parsed.args)
        except queue.Full:
            raise ApiError(
                429,
                "the request queue is full; retry later",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        self.live.add(sub)
        self.metrics.in_flight.set(len(self.live))

    def release(self, sub: Submission) -> None:
        """`sub` has ended (or its handler has): count it by its final state."""
        if sub not in self.live:
            return
        if not sub.tracker.is_final:  # the handler ended without a final event: its client went
            sub.abort(RequestEvent.cancel, "the handler ended")
        self.live.discard(sub)
        self.metrics.requests.labels(state=sub.state.value).inc()
        self.metrics.in_flight.set(len(self.live))
        if self.draining and not self.live:
            self.drained.set()

    def drain(self, timeout_s: float) -> None:
        """Begin the drain (on the event loop); see the module rules."""
        if self.draining:
            return
        self.draining = True
        for sub in list(self.live):
            if sub.state is RequestState.queued:
                sub.abort(RequestEvent.drain, "the server is shutting down")
        if not self.live:
            self.drained.set()
        asyncio.get_running_loop().call_later(timeout_s, self._timeout)

    def _timeout(self) -> None:
        for sub in list(self.live):
            sub.abort(RequestEvent.drain_timeout, "the server's drain timeout passed")

    def fail_all(self, reason: str) -> None:
        """A rank is lost (on the event loop): every open request fails at once (`rank_lost`)."""
        self.lost = reason
        for sub in list(self.live):
            sub.abort(RequestEvent.rank_lost, reason)
