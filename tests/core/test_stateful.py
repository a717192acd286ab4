"""Stateful test: random batch operations against a shadow model built on the oracle.

Rules of this file:
- The shadow model never asks the runtime what should happen: per uid it keeps a
  python-statemachine oracle (melix_fsm.oracle), its own pending-draft count and its own
  count of emitted tokens, and predicts every outcome from those. The runtime `Batch` must
  then agree on order, states, pending drafts and emitted tokens after every rule.
- Event lists are drawn mostly from what the oracle allows (so runs go deep into the
  lifecycle) and sometimes from the whole vocabulary with out-of-range payloads; a
  refused operation must raise the predicted typed error and change nothing at all.
- Every uid ever issued stays in the `uids` bundle, so rules keep drawing uids that were
  filtered out: events for them must raise UnknownSequence (removed_uids_rejected).
- Budget: the "default" Hypothesis profile (tests/conftest.py) keeps this to seconds;
  HYPOTHESIS_PROFILE=deep pytest tests/core/test_stateful.py is the long soak.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from statemachine import StateMachine

from melix_fsm.batch import Batch
from melix_fsm.errors import (
    BatchShapeError,
    DuplicateSequence,
    EventNotInOperation,
    IllegalTransition,
    InvalidEvent,
    LifecycleError,
    UnknownSequence,
)
from melix_fsm.invariants import (
    Snapshot,
    check_atomic_step,
    check_batch,
    check_removed_uids_rejected,
    check_reshape,
)
from melix_fsm.lifecycle import ADMIT, FINISH, REFUSE, Event, Signal, State, draft, verified
from melix_fsm.oracle import OracleMachine, TransitionNotAllowed, oracle_send, oracle_state
from melix_fsm.spec import load_batch, load_lifecycle

MAX_ROWS = 10  # keeps the default profile quick; the deep profile goes long, not wide
# What each batch operation may carry, read from the spec (the model's own copy of the rule).
OPERATIONS = {name: set(op.lifecycle_events) for name, op in load_batch(load_lifecycle()).operations.items()}
STEP_EVENTS = [e for e in Event if e in OPERATIONS["step"]]
ENDINGS = frozenset({Event("fault"), Event("finish")})  # drawn rarely: they end the cycle


@dataclass
class ShadowRow:
    """What the model believes about one live row."""

    oracle: StateMachine
    payload: object = field(default_factory=object)
    pending: int = 0  # drafts proposed and not yet verified
    emitted: int = 0  # tokens the row has emitted: only verified drafts, bonuses and plain steps

    @property
    def state(self) -> State:
        return oracle_state(self.oracle)

    def allows(self, event: str) -> bool:
        return any(e.id == event for e in self.oracle.allowed_events)


def apply(row: ShadowRow, signal: Signal, uid: Any = None) -> None:
    """Send one event to the shadow row; raises what the oracle raises, changing nothing then."""
    oracle_send(row.oracle, signal, row.pending, sequence=uid)
    event = signal.event
    if event == "draft":
        row.pending = signal.drafts
    elif event == "verified":
        row.emitted += signal.accepted + 1  # accepted drafts plus the verify's bonus token
        row.pending = 0
    elif event == "plain_step":
        row.emitted += 1
    elif event in ("fault", "finish"):
        row.pending = 0  # discarded, never emitted


def probe(row: ShadowRow) -> ShadowRow:
    """A throwaway copy of a shadow row, to predict an atomic step without committing it."""
    return ShadowRow(OracleMachine(row.state), row.payload, row.pending, row.emitted)


# The errors the runtime must raise for each kind of predicted refusal.
ILLEGAL, INVALID, UNKNOWN = IllegalTransition, InvalidEvent, UnknownSequence


def predict(
    shadow: dict[Any, ShadowRow], events: dict[Any, list[Signal]], operation: str
) -> type[LifecycleError] | None:
    """The error the batch must raise for `events` under `operation`, or None.

    An event the operation does not carry is refused first, whatever the rows."""
    if any(s.event not in OPERATIONS[operation] for signals in events.values() for s in signals):
        return EventNotInOperation
    for uid, signals in events.items():
        if uid not in shadow:
            return UNKNOWN
        trial = probe(shadow[uid])
        for signal in signals:
            try:
                apply(trial, signal)
            except TransitionNotAllowed:
                return ILLEGAL
            except InvalidEvent:
                return INVALID
    return None


def draw_signal(data: st.DataObject, row: ShadowRow, wild: bool) -> Signal:
    """One step event for `row`: from what its oracle allows, or (wild) anything at all,
    including events the step operation does not carry."""
    allowed = [e for e in STEP_EVENTS if row.allows(e)]
    lasting = [e for e in allowed if e not in ENDINGS]
    if lasting and data.draw(st.integers(0, 9), label="ending?") > 0:
        allowed = lasting
    event = data.draw(st.sampled_from(list(Event) if wild or not allowed else allowed))
    if event == "draft":
        return draft(data.draw(st.integers(-1 if wild else 1, 3)))
    if event == "verified":
        low, high = (-1, row.pending + 1) if wild else (0, row.pending)
        return verified(data.draw(st.integers(low, high)))
    return Signal(event=event)


class BatchLifecycle(RuleBasedStateMachine):
    uids = Bundle("uids")

    def __init__(self) -> None:
        super().__init__()
        self.batch = Batch()
        self.shadow: dict[Any, ShadowRow] = {}  # live rows in expected batch order
        self.removed: list[Any] = []
        self.retired_emitted = 0
        self.issued = 0

    # -- helpers --------------------------------------------------------------------------
    def new_uids(self, n: int) -> list[str]:
        out = [f"u{self.issued + i}" for i in range(n)]
        self.issued += n
        return out

    def expect_refusal(self, error: type[LifecycleError], op: Any) -> None:
        """`op` must raise exactly `error` (a LifecycleError) and change nothing."""
        before = Snapshot.of(self.batch)
        try:
            op()
        except LifecycleError as exc:
            assert isinstance(exc, error), f"expected {error.__name__}, got {exc!r}"
        else:
            raise AssertionError(f"expected {error.__name__}, nothing was raised")
        check_atomic_step(before, self.batch)

    def commit(self, events: dict[Any, list[Signal]]) -> None:
        """Apply a step the model predicted legal to the shadow rows."""
        for uid, signals in events.items():
            for signal in signals:
                apply(self.shadow[uid], signal, uid)

    def run_step(self, events: dict[Any, list[Signal]], op: Any, operation: str) -> None:
        error = predict(self.shadow, events, operation)
        if error is None:
            op()
            self.commit(events)
        else:
            self.expect_refusal(error, op)

    def pick_rows(self, data: st.DataObject, where: Any = None) -> list[Any]:
        live = [u for u, row in self.shadow.items() if where is None or where(row)]
        return data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []

    # -- reshaping --------------------------------------------------------------------------
    @initialize(target=uids, n=st.integers(1, 4))
    def start(self, n: int) -> Any:
        return self.extend_rows(n, via_batch=False)

    @precondition(lambda self: len(self.shadow) < MAX_ROWS)
    @rule(target=uids, n=st.integers(1, 3), via_batch=st.booleans())
    def extend(self, n: int, via_batch: bool) -> Any:
        return self.extend_rows(n, via_batch)

    def extend_rows(self, n: int, via_batch: bool) -> Any:
        uids = self.new_uids(n)
        rows = {uid: ShadowRow(OracleMachine()) for uid in uids}
        payloads = [row.payload for row in rows.values()]
        before = Snapshot.of(self.batch)
        if via_batch:  # a freshly prefilled batch merged in, as mlx-lm does
            other = Batch()
            other.extend(uids, payloads)
            self.batch.extend(other)
            assert len(other) == 0
        else:
            self.batch.extend(uids, payloads)
        check_reshape(before, self.batch)
        self.shadow.update(rows)
        return multiple(*uids)

    @rule(uid=uids, fresh=st.booleans())
    def extend_duplicate(self, uid: Any, fresh: bool) -> None:
        if uid in self.shadow:
            extra = self.new_uids(1) if fresh else []
            self.expect_refusal(DuplicateSequence, lambda: self.batch.extend([*extra, uid]))

    @rule(data=st.data())
    def filter(self, data: st.DataObject) -> None:
        n = len(self.shadow)
        mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="keep mask")
        keep = [i for i, k in enumerate(mask) if k]
        before = Snapshot.of(self.batch)
        by_uids = data.draw(st.booleans(), label="filter_uids")
        if by_uids:
            kept = [uid for uid, k in zip(self.shadow, mask) if k]
            self.batch.filter_uids(data.draw(st.permutations(kept)))
        else:
            self.batch.filter(keep)
        check_reshape(before, self.batch)
        for uid, k in list(zip(self.shadow, mask)):
            if not k:
                self.retired_emitted += self.shadow.pop(uid).emitted
                self.removed.append(uid)

    @precondition(lambda self: len(self.shadow) >= 2)
    @rule(data=st.data())
    def filter_reordered(self, data: st.DataObject) -> None:
        n = len(self.shadow)
        keep = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=n, unique=True))
        if keep == sorted(keep):
            keep.reverse()  # make sure it really reorders
        self.expect_refusal(BatchShapeError, lambda: self.batch.filter(keep))

    # -- lifecycle ----------------------------------------------------------------------------
    @rule(data=st.data(), stale=uids)
    def step(self, data: st.DataObject, stale: Any) -> None:
        events: dict[Any, list[Signal]] = {}
        for uid in self.shadow:
            if data.draw(st.integers(0, 3), label="row in step?") == 0:
                continue  # most rows take part in a step, as in a real decode batch
            row = probe(self.shadow[uid])  # draw along the row's own path through the step
            signals: list[Signal] = []
            for _ in range(data.draw(st.integers(1, 3), label="events in row")):
                wild = data.draw(st.integers(0, 9), label="wild?") == 0
                signal = draw_signal(data, row, wild)
                signals.append(signal)
                try:
                    apply(row, signal)
                except (TransitionNotAllowed, InvalidEvent):
                    break
                if signal.event not in OPERATIONS["step"]:
                    break
            events[uid] = signals
        if stale not in self.shadow and data.draw(st.integers(0, 4)) == 0:
            events[stale] = [FINISH]  # a uid that left the batch
        self.run_step(events, lambda: self.batch.step(events), "step")

    @rule(data=st.data())
    def resolve(self, data: st.DataObject) -> None:
        # now and then resolve a resolved row (a late refusal where the table allows it),
        # or hand resolve an event it does not carry
        wrong = data.draw(st.integers(0, 9)) == 0
        uids = self.pick_rows(data, None if wrong else lambda r: r.state == State.requested)
        choices = [ADMIT, ADMIT, ADMIT, REFUSE] + ([draft(1), FINISH] if wrong else [])
        decisions = {uid: data.draw(st.sampled_from(choices)) for uid in uids}
        events = {uid: [signal] for uid, signal in decisions.items()}
        self.run_step(events, lambda: self.batch.resolve(decisions), "resolve")

    @rule(data=st.data(), event=st.sampled_from(["suspend", "resume"]), everyone=st.booleans())
    def suspend_or_resume(self, data: st.DataObject, event: str, everyone: bool) -> None:
        signal = Signal(event=Event(event))
        op = self.batch.suspend if event == "suspend" else self.batch.resume
        if everyone:  # broadcast: exactly the rows where the oracle allows it
            expected = [uid for uid, row in self.shadow.items() if row.allows(event)]
            assert op() == expected
            self.commit({uid: [signal] for uid in expected})
            return
        uids = self.pick_rows(data)
        self.run_step({uid: [signal] for uid in uids}, lambda: op(uids), event)

    @rule(data=st.data(), event=st.sampled_from(["finish", "fault"]))
    def finish_or_fault(self, data: st.DataObject, event: str) -> None:
        uids = self.pick_rows(data)
        op = self.batch.finish if event == "finish" else self.batch.fault
        self.run_step({uid: [Signal(event=Event(event))] for uid in uids}, lambda: op(uids, "test"), event)

    @rule(uid=uids)
    def event_for_any_uid(self, uid: Any) -> None:
        if uid in self.shadow:
            assert self.batch.state(uid) == self.shadow[uid].state
        else:
            self.expect_refusal(UnknownSequence, lambda: self.batch.send(uid, FINISH))
            self.expect_refusal(UnknownSequence, lambda: self.batch.state(uid))

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def model_agrees(self) -> None:
        check_batch(self.batch)
        assert self.batch.uids == list(self.shadow)
        for row in self.batch:
            model = self.shadow[row.uid]
            assert row.state == model.state, (row.uid, row.state, model.state)
            assert row.counters.pending == model.pending
            # no pending draft is emitted before its verification
            assert row.counters.emitted == model.emitted
            assert row.payload is model.payload
        totals = self.batch.totals()
        assert totals.emitted == self.retired_emitted + sum(r.emitted for r in self.shadow.values())
        assert set(self.batch.retired_uids) == set(self.removed)

    @invariant()
    def removed_uids_rejected(self) -> None:
        check_removed_uids_rejected(self.batch, self.removed)


TestBatchLifecycle = BatchLifecycle.TestCase
