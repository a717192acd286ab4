"""Every machine of spec/ is compiled twice (table runtime, python-statemachine oracle)
and the two agree on every (state, event) cell, for both values of each guard.

Rules of this file:
- The machines are found from `melix_fsm.spec.MACHINES`: a new spec file joins every
  test here (and the diagrams, and `diagram --check`) by being listed there.
- The lifecycle's own cell tests live in test_conformance.py (its events carry payloads);
  here it is compiled generically as well, which checks that the generic compiler reads
  the lifecycle's file exactly as its dedicated one does.
"""

from __future__ import annotations

import enum
import itertools

import pytest
from statemachine.exceptions import TransitionNotAllowed

from melix_fsm import diagrams, lifecycle
from melix_fsm.errors import IllegalTransition
from melix_fsm.machine import CompiledMachine, MissingGuard, build_oracle
from melix_fsm.pipeline import PIPELINE
from melix_fsm.policy.depth import DEPTH
from melix_fsm.policy.modes import CONTROLLER
from melix_fsm.request import REQUEST
from melix_fsm.spec import MACHINES, SpecError, load_machine, spec_dir

LIFECYCLE = CompiledMachine(
    lifecycle.SPEC, lifecycle.State, lifecycle.Event, frozenset(lifecycle.SPEC.guards)
)
COMPILED = {
    "lifecycle": LIFECYCLE,
    "controller": CONTROLLER,
    "depth": DEPTH,
    "pipeline": PIPELINE,
    "request": REQUEST,
}


def test_every_listed_machine_has_a_spec_file_a_runtime_and_diagrams() -> None:
    assert set(COMPILED) == set(MACHINES)
    for name in MACHINES:
        assert (spec_dir() / f"{name}.toml").is_file()
        assert f"{name}.mmd" in diagrams.TEXT_RENDERERS and f"{name}.md" in diagrams.TEXT_RENDERERS
    with pytest.raises(SpecError):
        load_machine("no_such_machine")


def _guard_worlds(machine: CompiledMachine) -> list[dict[str, bool]]:
    names = sorted(machine.spec.guards)
    return [dict(zip(names, values)) for values in itertools.product([True, False], repeat=len(names))]


@pytest.mark.parametrize("name", MACHINES)
def test_runtime_and_oracle_agree_on_every_cell(name: str) -> None:
    machine = COMPILED[name]
    oracle_class = build_oracle(machine.spec)
    for state, event, guards in itertools.product(machine.states, machine.events, _guard_worlds(machine)):
        try:
            expected: enum.StrEnum | None = machine.target(state, event, guards)
        except IllegalTransition:
            expected = None
        oracle = oracle_class(start_value=state.value)
        try:
            oracle.send(event.value, **guards)
            got = oracle.current_state_value
        except TransitionNotAllowed:
            got = None
        assert got == expected, (name, state, event, guards, got, expected)


@pytest.mark.parametrize("name", MACHINES)
def test_a_refused_event_leaves_the_tracker_unchanged(name: str) -> None:
    machine = COMPILED[name]
    for state in machine.states:
        for event in machine.events:
            if machine.allows(state, event):
                continue
            tracker = machine.tracker(state)
            with pytest.raises(IllegalTransition):
                tracker.send(event)
            assert tracker.state is state and tracker.history == [] and tracker.sent == 0


def test_a_guarded_cell_needs_its_guard() -> None:
    tracker = CONTROLLER.tracker()
    with pytest.raises(MissingGuard):
        tracker.send(CONTROLLER.events("resolve"))
    assert tracker.state is CONTROLLER.initial
    tracker.send(CONTROLLER.events("resolve"), "prior", prior_admits=False)
    assert tracker.state == "suspended" and tracker.history[-1].guard == "!prior_admits"


def test_vocabulary_must_match_the_spec() -> None:
    Wrong = enum.StrEnum("Wrong", ["queued", "prefilling"])
    with pytest.raises(RuntimeError, match="differ from the spec"):
        CompiledMachine(REQUEST.spec, Wrong, REQUEST.events, frozenset())
    with pytest.raises(RuntimeError, match="guards"):
        CompiledMachine(PIPELINE.spec, PIPELINE.states, PIPELINE.events, frozenset())


def test_history_is_bounded() -> None:
    tracker = PIPELINE.tracker()
    tracker.keep_history = 10
    for _ in range(50):
        tracker.send(PIPELINE.events("launch"))
        tracker.send(PIPELINE.events("settle"))
    assert 10 <= len(tracker.history) <= 20 and tracker.sent == 100
    assert tracker.history[-1] == ("in_flight", "settle", "idle", None, "")
