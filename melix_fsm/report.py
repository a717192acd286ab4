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
- A report must be consistent on its own: `validate_report` checks the shape (unique
  uids, joined rows last in append order, left rows among the rows, `order` = the rows
  minus the left ones) and raises `InvalidReport` naming the first problem. Whether the
  events are legal and the order matches the batch needs history: the conformance kit's
  mirror (melix_fsm.testing) checks that.
- What a row's `emitted` may hold, given its events: one token per `plain_step`,
  `accepted + 1` per `verified` (the accepted drafts, then the verify's own token), plus
  the prefill's first token when the row joined in this step; fewer only when the row
  finished in this step (the cut falls at its stop sequence or length). A draft is never
  emitted before its `verified`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .counters import Counters
from .errors import MelixError
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


class InvalidReport(MelixError, ValueError):
    """A StepReport is inconsistent on its own; `problem` says how."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(f"invalid step report: {problem}")


def validate_report(report: StepReport) -> None:
    """Check the shape rules of the module docstring; raise `InvalidReport` on the first miss."""
    if not isinstance(report, StepReport):
        raise InvalidReport(f"expected a StepReport, got {type(report).__name__}")
    uids = [r.uid for r in report.rows]
    if len(set(uids)) != len(uids):
        raise InvalidReport(f"a uid appears twice among the rows {uids}")
    for r in report.rows:
        bad = [s for s in r.events if not isinstance(s, Signal)]
        if bad:
            raise InvalidReport(f"row {r.uid!r}: events must be Signals, got {bad[0]!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in r.emitted):
            raise InvalidReport(f"row {r.uid!r}: emitted tokens must be ints, got {r.emitted}")
        if r.counters is not None and not isinstance(r.counters, Counters):
            raise InvalidReport(f"row {r.uid!r}: counters must be Counters or None")
    # Joiners are appended: they are the last rows, in append order.
    if report.joined and uids[len(uids) - len(report.joined) :] != list(report.joined):
        raise InvalidReport(f"joined {report.joined} are not the last rows of {uids}")
    missing = [u for u in report.left if u not in set(uids)]
    if missing or len(set(report.left)) != len(report.left):
        raise InvalidReport(f"left {report.left} must be distinct uids among the rows {uids}")
    left = set(report.left)
    survivors = [u for u in uids if u not in left]
    if list(report.order) != survivors:
        raise InvalidReport(f"order {report.order} != the rows minus the left ones {survivors}")
