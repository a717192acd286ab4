"""The served request's machine, compiled from spec/request.toml (melix_fsm.machine).

The server (melix_mlx.serve) keeps one `REQUEST.tracker()` per accepted request and sends
every event of its life through it; a request's end (finished, cancelled, failed) is
reached exactly once, and any event the table lacks raises `IllegalTransition`.
No transition is written here.
"""

from __future__ import annotations

import enum

from .machine import CompiledMachine, Tracker
from .spec import load_machine


class RequestState(enum.StrEnum):
    """spec/request.toml [states], in the spec's order (checked at import)."""

    queued = "queued"
    prefilling = "prefilling"
    generating = "generating"
    finished = "finished"
    cancelled = "cancelled"
    failed = "failed"


class RequestEvent(enum.StrEnum):
    """spec/request.toml [events], in the spec's order (checked at import)."""

    start_prefill = "start_prefill"
    prefill_chunk = "prefill_chunk"
    first_token = "first_token"
    token = "token"
    complete = "complete"
    cancel = "cancel"
    fault = "fault"
    drain = "drain"
    drain_timeout = "drain_timeout"
    rank_lost = "rank_lost"


REQUEST: CompiledMachine[RequestState, RequestEvent] = CompiledMachine(
    load_machine("request"), RequestState, RequestEvent, frozenset()
)

RequestTracker = Tracker[RequestState, RequestEvent]


def new_request() -> RequestTracker:
    """A request just accepted: queued."""
    return REQUEST.tracker()
