"""Conformance: the runtime table and the python-statemachine oracle agree on every cell.

Rules of this file:
- Every (state, event) pair of the vocabulary is a test case, legal or not; guarded cells
  are tested on both guard outcomes, and payload-checked events with bad payloads too.
- Runtime and oracle are two compilations of spec/lifecycle.toml: they must reach the same
  state, or both refuse for the same reason (illegal cell / invalid payload).
- A refusal raises a typed error and leaves the machine's state and counters as they were.
- The fuzz test sends arbitrary event sequences: only `LifecycleError` subclasses escape.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from statemachine import StateChart, StateMachine

from melix_fsm.counters import Counters
from melix_fsm.errors import IllegalTransition, InvalidEvent, LifecycleError
from melix_fsm.lifecycle import (
    INITIAL,
    TABLE,
    Event,
    Guarded,
    SequenceMachine,
    Signal,
    State,
    draft,
    legal_events,
    pending_after,
    target_of,
    verified,
)
from melix_fsm.oracle import (
    LifecycleOracle,
    OracleMachine,
    Refusal,
    TransitionNotAllowed,
    oracle_outcome,
    oracle_send,
    oracle_state,
    oracle_target,
)

IN_CYCLE = {State("drafting"), State("verifying")}
PENDING = 2  # drafts pending in the in-cycle states of the cell tests


def pending_in(state: State) -> int:
    """A pending count consistent with `state` (pending_only_in_cycle)."""
    return PENDING if state in IN_CYCLE else 0


def machine_in(uid: str, state: State) -> SequenceMachine:
    """A machine sitting in `state` with counters that satisfy the batch invariants."""
    p = pending_in(state)
    counters = Counters(proposed=p, pending=p, position_proposed=[1] * p)
    return SequenceMachine(uid, state, counters)


def signals_for(event: Event) -> list[Signal]:
    """Valid payloads for `event` (both guard outcomes for verified)."""
    if event == "draft":
        return [draft(1), draft(3)]
    if event == "verified":
        return [verified(PENDING), verified(1), verified(0)]
    return [Signal(event=event, reason="test")]


def bad_signals_for(event: Event) -> list[Signal]:
    if event == "draft":
        return [draft(0), draft(-1)]
    if event == "verified":
        return [verified(PENDING + 1), verified(-1)]
    return []


def runtime_outcome(state: State, signal: Signal, pending: int) -> State | Refusal:
    try:
        return target_of("u", state, pending, signal)
    except IllegalTransition:
        return Refusal.ILLEGAL
    except InvalidEvent:
        return Refusal.INVALID


def snapshot(m: SequenceMachine) -> tuple[State, dict]:
    return m.state, m.counters.summary()


CELLS = list(itertools.product(State, Event))


def test_vocabulary_and_cells_cover_the_spec() -> None:
    assert len(CELLS) == len(State) * len(Event)
    assert {(s, e) for s, e in CELLS if (s, e) in TABLE} == set(TABLE)


@pytest.mark.parametrize(("state", "event"), CELLS, ids=[f"{s.value}-{e.value}" for s, e in CELLS])
def test_cell_runtime_and_oracle_agree(state: State, event: Event) -> None:
    pending = pending_in(state)
    for signal in signals_for(event) + bad_signals_for(event):
        expected = runtime_outcome(state, signal, pending)
        assert oracle_outcome(state, signal, pending) == expected, (state, signal)
        target = oracle_target(state, signal, pending)
        assert target == (None if isinstance(expected, Refusal) else expected)

        m = machine_in("u", state)
        before = snapshot(m)
        if expected is Refusal.ILLEGAL:
            with pytest.raises(IllegalTransition) as info:
                m.send(signal)
            err = info.value
            assert (err.sequence, err.state, err.event) == ("u", state, event)
            assert err.__cause__ is None and err.__context__ is None  # no chained KeyError
            assert snapshot(m) == before
        elif expected is Refusal.INVALID:
            with pytest.raises(InvalidEvent) as info2:
                m.send(signal)
            assert (info2.value.sequence, info2.value.event) == ("u", event)
            assert snapshot(m) == before
        else:
            assert m.send(signal) == expected
            oracle = OracleMachine(state)
            assert oracle_send(oracle, signal, pending) == expected


def test_every_cell_is_decided() -> None:
    """The cells are exactly the table: each legal cell has a target, the rest refuse."""
    for state, event in CELLS:
        signal = signals_for(event)[0]
        outcome = oracle_outcome(state, signal, pending_in(state))
        assert isinstance(outcome, State) == ((state, event) in TABLE), (state, event)


def test_guarded_cell_both_outcomes() -> None:
    guarded = {key: cell for key, cell in TABLE.items() if isinstance(cell, Guarded)}
    assert guarded, "the spec has a guarded cell; the test must see it"
    verifying, ev = State("verifying"), Event("verified")
    assert (verifying, ev) in guarded
    for pending in (1, 2, 3):
        for accepted in range(pending + 1):
            expected = State("accepted") if accepted == pending else State("rolled_back")
            assert target_of("u", verifying, pending, verified(accepted)) == expected
            assert oracle_target(verifying, verified(accepted), pending) == expected


@pytest.mark.parametrize(
    ("state", "signal", "pending"),
    [
        (State("admitted"), draft(0), 0),
        (State("accepted"), draft(-2), 0),
        (State("verifying"), verified(3), 2),
        (State("verifying"), verified(-1), 2),
    ],
)
def test_invalid_payload_leaves_state_unchanged(state: State, signal: Signal, pending: int) -> None:
    counters = Counters(proposed=pending, pending=pending, position_proposed=[1] * pending)
    m = SequenceMachine("u", state, counters)
    before = snapshot(m)
    with pytest.raises(InvalidEvent) as info:
        m.send(signal)
    assert info.value.event == signal.event and info.value.detail
    assert snapshot(m) == before
    assert oracle_outcome(state, signal, pending) is Refusal.INVALID
    oracle = OracleMachine(state)
    with pytest.raises(InvalidEvent):
        oracle_send(oracle, signal, pending)
    assert oracle_state(oracle) == state


def test_illegal_payload_on_illegal_cell_is_illegal_first() -> None:
    # The table is consulted before the payload: a bad draft where drafting is illegal
    # is an IllegalTransition in both compilations.
    assert runtime_outcome(State("requested"), draft(0), 0) is Refusal.ILLEGAL
    assert oracle_outcome(State("requested"), draft(0), 0) is Refusal.ILLEGAL


def test_oracle_is_a_strict_statemachine() -> None:
    assert issubclass(LifecycleOracle, StateMachine)
    assert LifecycleOracle.allow_event_without_transition is False
    assert LifecycleOracle is not StateChart
    oracle = OracleMachine()
    assert oracle_state(oracle) == INITIAL
    with pytest.raises(TransitionNotAllowed):
        oracle.send("no_such_event")
    with pytest.raises(TransitionNotAllowed):
        oracle.send("verify")
    assert oracle_state(oracle) == INITIAL


def test_oracle_states_and_finals_match_the_spec() -> None:
    assert {s.value for s in LifecycleOracle.states} == {s.value for s in State}
    assert {s.value for s in LifecycleOracle.final_states} == {"finished"}
    assert LifecycleOracle.initial_state.value == INITIAL.value


def test_legal_events_match_oracle() -> None:
    for state in State:
        pending = pending_in(state)
        allowed = [e for e in Event if oracle_target(state, signals_for(e)[0], pending) is not None]
        assert legal_events(state) == allowed


# -- fuzz: only typed errors escape, and the two compilations stay in lockstep ---------------

signals = st.builds(
    Signal,
    event=st.sampled_from(list(Event)),
    drafts=st.integers(-1, 4),
    accepted=st.integers(-1, 5),
    reason=st.sampled_from(["", "fuzz"]),
)


@given(st.lists(signals, max_size=40))
def test_fuzz_only_typed_errors_and_oracle_lockstep(events: list[Signal]) -> None:
    machine = SequenceMachine("f")
    oracle = OracleMachine()
    for signal in events:
        before = snapshot(machine)
        pending = machine.pending
        try:
            machine.send(signal)
        except LifecycleError as exc:
            assert isinstance(exc, IllegalTransition | InvalidEvent)
            assert snapshot(machine) == before
            with pytest.raises((TransitionNotAllowed, InvalidEvent)):
                oracle_send(oracle, signal, pending)
        else:
            assert oracle_send(oracle, signal, pending) == machine.state
            assert machine.pending == pending_after(pending, signal)
        assert oracle_state(oracle) == machine.state
        assert (machine.pending > 0) == (machine.state in IN_CYCLE)
