"""The step rules both decoders share (melix_mlx.decoding.step_rules), held against the lifecycle.

Rules of this file:
- Every sequence of signals the rules produce is legal in the lifecycle from the states
  the decoders apply it in (checked through the runtime table), and the controller is
  fed exactly the outcome the signals carry.
- `steer` never picks a row the lifecycle would refuse the event for.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from melix_mlx.decoding import step_rules

from melix_fsm import lifecycle as lc
from melix_fsm.lifecycle import SequenceMachine, State


@given(k=st.integers(0, 4), data=st.data())
def test_a_settled_step_is_legal_from_every_ready_state(k: int, data) -> None:
    accepted = data.draw(st.integers(0, k))
    start = data.draw(st.sampled_from(sorted(lc.CYCLE_READY if k else {State.refused, State.suspended})))
    machine = SequenceMachine(0, start)
    for signal in step_rules.step_signals(k, accepted):
        machine.send(signal)
    if k:
        assert machine.state is (State.accepted if accepted == k else State.rolled_back)
        assert machine.counters.accepted == accepted and machine.counters.proposed == k
    else:
        assert machine.state is start


@pytest.mark.parametrize("drafted", [True, False])
def test_a_fault_records_the_drafts_that_existed(drafted: bool) -> None:
    machine = SequenceMachine(0, State.admitted)
    before, fault = step_rules.fault_signals(2, drafted, "boom")
    for signal in (*before, fault):
        machine.send(signal)
    assert machine.state is State.faulted and machine.counters.faults == 1
    assert machine.counters.proposed == (2 if drafted else 0)
    assert fault.reason == "boom"


def test_verify_outcome_sums_rows_per_position() -> None:
    rows = [
        step_rules.step_signals(3, 2),
        step_rules.step_signals(2, 0),
        step_rules.step_signals(0, 0),
        [lc.ADMIT],  # events that are not a verify count nothing
    ]
    assert step_rules.verify_outcome(rows) == (2, 5, [1, 1, 0])


class Ctrl:
    def __init__(self, speculating: bool) -> None:
        self.speculating = speculating
        self.events: list = []
        self.updates: list = []

    def update(self, *args, **kw) -> None:
        self.updates.append((args, kw))


@given(states=st.lists(st.sampled_from(list(State)), max_size=8), data=st.data())
def test_steer_picks_only_rows_the_lifecycle_allows(states: list[State], data) -> None:
    speculating = data.draw(st.booleans())
    ahead = data.draw(st.lists(st.booleans(), min_size=len(states), max_size=len(states)))
    signal, rows = step_rules.steer(Ctrl(speculating), states, ahead)
    assert signal.event is (lc.Event.resume if speculating else lc.Event.suspend)
    for i, state in enumerate(states):
        legal = (state, signal.event) in lc.TABLE
        expected = legal and not (speculating and ahead[i])
        assert (i in rows) == expected, (state, speculating, ahead[i])


def test_feed_passes_the_outcome_the_budget_and_the_price() -> None:
    ctrl = Ctrl(True)
    step_rules.feed(ctrl, 2, [step_rules.step_signals(2, 1)], seconds=0.5, tokens=3, remaining=7, priced_at=4)
    (args, kw), = ctrl.updates
    assert args == (2, 1, 2)
    assert kw == {
        "seconds": 0.5,
        "tokens": 3,
        "accepted_per_position": [1, 0],
        "exclude": False,
        "remaining": 7,
        "priced_at": 4,
    }


def test_ahead_fits() -> None:
    assert step_rules.ahead_fits([2, 0], [2, 0], [False, False])
    assert step_rules.ahead_fits([1], [2], [False])  # shallower than allowed: still fits
    assert not step_rules.ahead_fits([2], [1], [False])  # deeper than now allowed
    assert not step_rules.ahead_fits([0], [2], [False])  # plain where the row speculates now
    assert step_rules.ahead_fits([0], [2], [True])  # ... unless it resumes after that plain step
    assert not step_rules.ahead_fits([2], [0], [True])  # a cycle where the row decodes plainly
    assert not step_rules.ahead_fits([1, 1], [1], [False, False])  # other rows
