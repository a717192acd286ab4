"""The event-reporting contract: what a speculative generator reports after each step.

Rules of this module:
- A generator that adopts the contract exposes `last_report: StepReport` after every
  `next()` call. It is plain data (msgspec Structs), so it can cross process boundaries
  and be checked by the conformance kit (melix_fsm.testing) or logged as JSON.
- `rows` lists every row that took part in the step, in the generator's cache-row order
  *after* this step's joins and *before* this step's leaves. Each row lists the lifecycle
  events it went through in this step, in order (spec/lifecycle.toml decides whether they
  are legal), and the tokens it emitted to the caller in this step.
- `joined` are the uids appended to the batch during the step, in append order (they
  start in the lifecycle's initial state, so their events begin with admit or refuse);
  `left` are the uids filtered out at the end of the step; `order` is the row order after
  the step. Rows removed by the caller between steps (`remove`) are not reported: the
  caller knows them.
- `counters` is optional: a generator that keeps its own per-row counters reports them
  so the kit can check they agree with the events.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .counters import Counters
from .lifecycle import Signal


class RowReport(msgspec.Struct, kw_only=True):
    uid: Any
    events: list[Signal] = msgspec.field(default_factory=list)
    emitted: list[int] = msgspec.field(default_factory=list)
    counters: Counters | None = None


class StepReport(msgspec.Struct, kw_only=True):
    rows: list[RowReport] = msgspec.field(default_factory=list)
    joined: list[Any] = msgspec.field(default_factory=list)
    left: list[Any] = msgspec.field(default_factory=list)
    order: list[Any] = msgspec.field(default_factory=list)

    def row(self, uid: Any) -> RowReport | None:
        for r in self.rows:
            if r.uid == uid:
                return r
        return None
