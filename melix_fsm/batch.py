"""The batch: an ordered composition of per-sequence machines (spec/batch.toml).

Rules of this module:
- Row i of a `Batch` is row i of every cache an adapter holds. `extend` appends,
  `filter` keeps rows at strictly increasing indices: no operation reorders rows.
- Reshaping never touches a surviving row: its machine, counters and payload object
  travel as they are. Rows that leave retire their counters into `retired`, so batch
  totals cover every row that was ever in the batch.
- Every lifecycle operation goes through one funnel, `apply(operation, events)`: the
  events must be ones spec/batch.toml lists for that operation (else
  `EventNotInOperation`), then events for all rows are planned (pure) and committed;
  one illegal row event raises and no row changes. An event for a uid that is not in
  the batch raises `UnknownSequence`.
- The payload slot is opaque here: adapters keep pending drafts, head-cache rows and
  the last hidden state in it. This module never reads it.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from .counters import Counters, total
from .errors import BatchShapeError, DuplicateSequence, EventNotInOperation, UnknownSequence
from .lifecycle import (
    FAULT,
    FINISH,
    REFUSE,
    RESUME,
    SPEC,
    SUSPEND,
    TABLE,
    Event,
    SequenceMachine,
    Signal,
    State,
    pending_after,
    target_of,
)
from .spec import load_batch

Uid = Hashable
Events = Mapping[Uid, Signal | Sequence[Signal]]

BATCH_SPEC = load_batch(SPEC)


class Operation(enum.StrEnum):
    """The batch operations (spec/batch.toml [operations]), checked against the spec at import."""

    extend = "extend"
    filter = "filter"
    step = "step"
    resolve = "resolve"
    suspend = "suspend"
    resume = "resume"
    finish = "finish"
    fault = "fault"


if [o.value for o in Operation] != list(BATCH_SPEC.operations):
    raise RuntimeError(
        f"batch operations differ from spec/batch.toml: code {[o.value for o in Operation]}, "
        f"spec {list(BATCH_SPEC.operations)}"
    )

# Which lifecycle events each batch operation may carry (spec/batch.toml), enforced by `apply`.
OPERATION_EVENTS: dict[str, frozenset[Event]] = {
    Operation(name): frozenset(Event(e) for e in op.lifecycle_events)
    for name, op in BATCH_SPEC.operations.items()
}


def operation_for(event: Event) -> str:
    """The batch operation that carries `event` during decoding: `step` where it lists the
    event, otherwise the one operation that does (used to replay a generator's report)."""
    owners = [name for name, events in OPERATION_EVENTS.items() if event in events]
    if "step" in owners:
        return "step"
    if len(owners) != 1:
        raise RuntimeError(f"spec/batch.toml: event {event.value!r} belongs to operations {owners}")
    return owners[0]


class Row:
    """One sequence in the batch: its machine plus an opaque adapter payload."""

    __slots__ = ("machine", "payload")

    def __init__(self, machine: SequenceMachine, payload: Any = None) -> None:
        self.machine = machine
        self.payload = payload

    @property
    def uid(self) -> Uid:
        return self.machine.uid

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def counters(self) -> Counters:
        return self.machine.counters

    def __repr__(self) -> str:
        return f"Row({self.uid!r}, {self.state.value})"


class Batch:
    """Ordered rows, each with a lifecycle machine, counters and payload."""

    def __init__(self, uids: Iterable[Uid] = ()) -> None:
        self._rows: list[Row] = []
        self._index: dict[Uid, int] = {}
        self.retired = Counters()  # summed counters of every row filtered out
        self.retired_uids: list[Uid] = []
        if uids:
            self.extend(uids)

    # -- reading ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self._rows)

    def __contains__(self, uid: object) -> bool:
        return uid in self._index

    @property
    def uids(self) -> list[Uid]:
        return [row.uid for row in self._rows]

    @property
    def rows(self) -> tuple[Row, ...]:
        return tuple(self._rows)

    def index(self, uid: Uid) -> int:
        try:
            return self._index[uid]
        except KeyError:
            raise UnknownSequence(uid) from None

    def row(self, uid: Uid) -> Row:
        return self._rows[self.index(uid)]

    def state(self, uid: Uid) -> State:
        return self.row(uid).state

    def totals(self) -> Counters:
        """Counters summed over live rows and every retired row."""
        out = total([row.counters for row in self._rows])
        out.add(self.retired)
        return out

    # -- reshaping -------------------------------------------------------------
    def extend(self, other: Batch | Iterable[Uid], payloads: Sequence[Any] | None = None) -> None:
        """Append rows after the existing ones, in order.

        `other` is another Batch (its rows move here with their state, counters and
        payload, the way mlx-lm merges a freshly prefilled batch) or uids for new rows
        in the initial state, with optional payloads aligned to them.
        """
        if isinstance(other, Batch):
            new_rows = list(other._rows)
        else:
            uids = list(other)
            if payloads is not None and len(payloads) != len(uids):
                raise BatchShapeError(f"{len(uids)} uids but {len(payloads)} payloads")
            new_rows = [
                Row(SequenceMachine(uid), payloads[i] if payloads is not None else None)
                for i, uid in enumerate(uids)
            ]
        seen = set(self._index)
        for row in new_rows:
            if row.uid in seen:
                raise DuplicateSequence(row.uid)
            seen.add(row.uid)
        for row in new_rows:
            self._index[row.uid] = len(self._rows)
            self._rows.append(row)
        if isinstance(other, Batch):  # rows moved: the source must not keep aliases
            self.retired.add(other.retired)  # and its retired rows now count here
            self.retired_uids.extend(other.retired_uids)
            other._rows, other._index = [], {}
            other.retired, other.retired_uids = Counters(), []

    def filter(self, keep: Sequence[int]) -> None:
        """Keep the rows at `keep` (strictly increasing indices), as mlx-lm's filter does."""
        n = len(self._rows)
        previous = -1
        for i in keep:
            if not isinstance(i, int) or isinstance(i, bool):
                raise BatchShapeError(f"filter indices must be ints, got {i!r}")
            if not 0 <= i < n:
                raise BatchShapeError(f"filter index {i} is outside a batch of {n} rows")
            if i <= previous:
                raise BatchShapeError(f"filter indices must be strictly increasing, got {list(keep)}")
            previous = i
        kept = set(keep)
        for i, row in enumerate(self._rows):
            if i not in kept:
                self.retired.add(row.counters)
                self.retired_uids.append(row.uid)
        self._rows = [self._rows[i] for i in keep]
        self._index = {row.uid: i for i, row in enumerate(self._rows)}

    def filter_uids(self, keep: Iterable[Uid]) -> None:
        """Keep the rows whose uids are given (in batch order, whatever order `keep` has)."""
        wanted = set(keep)
        for uid in wanted:
            self.index(uid)  # raises UnknownSequence
        self.filter([i for i, row in enumerate(self._rows) if row.uid in wanted])

    # -- lifecycle -------------------------------------------------------------
    def apply(self, operation: str, events: Events) -> None:
        """The one funnel for lifecycle events: check them against `operation`'s events in
        spec/batch.toml, plan every row, then commit every row.

        Rows not named in `events` are untouched. Any error (an event the operation does
        not carry, an unknown uid, an illegal event, a bad payload) raises before a single
        row changes.
        """
        allowed = OPERATION_EVENTS.get(operation)
        if allowed is None:
            raise BatchShapeError(f"no batch operation {operation!r} in spec/batch.toml")
        normalised = {uid: (s,) if isinstance(s, Signal) else tuple(s) for uid, s in events.items()}
        for uid, signals in normalised.items():
            for signal in signals:
                if signal.event not in allowed:
                    spec_order = tuple(e for e in BATCH_SPEC.operations[operation].lifecycle_events)
                    raise EventNotInOperation(operation, uid, signal.event, spec_order)
        plans: list[tuple[SequenceMachine, list[tuple[Signal, State]]]] = []
        for uid, signals in normalised.items():
            machine = self.row(uid).machine
            state, pending = machine.state, machine.counters.pending
            planned = []
            for signal in signals:
                target = target_of(uid, state, pending, signal)
                planned.append((signal, target))
                state, pending = target, pending_after(pending, signal)
            plans.append((machine, planned))
        for machine, planned in plans:
            for signal, target in planned:
                machine.commit(signal, target)

    def send(self, uid: Uid, signal: Signal) -> State:
        """One event for one row, through the operation that carries it (`operation_for`)."""
        self.apply(operation_for(signal.event), {uid: signal})
        return self.row(uid).state

    def step(self, events: Events) -> None:
        """One decode step's per-row event lists (draft, verify, verified, plain_step, fault,
        finish), atomically."""
        self.apply("step", events)

    def _broadcast(self, operation: str, signal: Signal, uids: Iterable[Uid] | None) -> list[Uid]:
        """Send `signal` to the given rows (atomic), or to every row where it is legal."""
        if uids is None:
            chosen = [row.uid for row in self._rows if (row.state, signal.event) in TABLE]
        else:
            chosen = list(dict.fromkeys(uids))  # each row once, in the order given
        self.apply(operation, {uid: signal for uid in chosen})
        return chosen

    def resolve(self, decisions: Mapping[Uid, Signal]) -> None:
        """Admit or refuse requested rows, or refuse admitted rows late (atomic)."""
        self.apply("resolve", decisions)

    def refuse(self, uids: Iterable[Uid], reason: str) -> list[Uid]:
        """Refuse speculation for good (late refusal at a cycle boundary); returns the uids."""
        return self._broadcast("resolve", Signal(event=REFUSE.event, reason=reason), uids)

    def suspend(self, uids: Iterable[Uid] | None = None, reason: str = "") -> list[Uid]:
        """Suspend the given rows, or every row at a cycle boundary; returns the uids."""
        signal = SUSPEND if not reason else Signal(event=SUSPEND.event, reason=reason)
        return self._broadcast("suspend", signal, uids)

    def resume(self, uids: Iterable[Uid] | None = None, reason: str = "") -> list[Uid]:
        """Resume the given rows, or every suspended row; returns the uids."""
        signal = RESUME if not reason else Signal(event=RESUME.event, reason=reason)
        return self._broadcast("resume", signal, uids)

    def finish(self, uids: Iterable[Uid], reason: str = "") -> list[Uid]:
        signal = FINISH if not reason else Signal(event=FINISH.event, reason=reason)
        return self._broadcast("finish", signal, uids)

    def fault(self, uids: Iterable[Uid], reason: str = "") -> list[Uid]:
        signal = FAULT if not reason else Signal(event=FAULT.event, reason=reason)
        return self._broadcast("fault", signal, uids)
