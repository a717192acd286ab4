"""The conformance oracle: a python-statemachine class compiled from the same spec.

Rules of this module:
- It reads `melix_fsm.lifecycle.SPEC` (the parsed spec/lifecycle.toml) and nothing else
  about transitions: no transition is written here. The runtime table and this class are
  two independent compilations of one spec, so tests can hold them against each other.
- The class derives from `statemachine.StateMachine`, never `StateChart`: a StateChart
  silently ignores events without a transition, which would hide exactly the disagreements
  the oracle exists to find.
- Guards are conditions on the event payload (`pending`, `drafts`, `accepted`) with the
  meanings of `melix_fsm.lifecycle.GUARDS`; "G" becomes `cond=G` and "!G" `unless=G`, as the
  spec writes them. Payload checks (`melix_fsm.lifecycle.CHECKS`) run as validators and
  raise `InvalidEvent`; a missing transition raises python-statemachine's
  `TransitionNotAllowed`.
- The oracle is slow (~100 us a transition) and is for tests, diagrams and benchmarks only:
  nothing on the decode path imports this module.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from statemachine import StateMachine
from statemachine.exceptions import TransitionNotAllowed

from .errors import InvalidEvent
from .lifecycle import CHECKS, GUARDS, SPEC, Event, Signal, State
from .machine import build_oracle
from .spec import LifecycleSpec

__all__ = [
    "LifecycleOracle",
    "OracleMachine",
    "Refusal",
    "TransitionNotAllowed",
    "build_oracle_class",
    "oracle_outcome",
    "oracle_send",
    "oracle_state",
    "oracle_target",
]


class Refusal(enum.StrEnum):
    """Why the oracle refused an event."""

    ILLEGAL = "illegal"  # no transition for (state, event): TransitionNotAllowed
    INVALID = "invalid"  # a transition exists but the payload is bad: InvalidEvent


def _condition(name: str) -> Callable[..., bool]:
    meaning = GUARDS[name]

    # python-statemachine injects send() keyword arguments by parameter name.
    def condition(pending: int = 0, drafts: int = 0, accepted: int = 0, **_: Any) -> bool:
        return meaning(pending, drafts, accepted)

    condition.__name__ = name
    return condition


def _validator(event: str) -> Callable[..., None] | None:
    check = CHECKS.get(Event(event))
    if check is None:
        return None

    def validator(
        pending: int = 0, drafts: int = 0, accepted: int = 0, sequence: Any = None, **_: Any
    ) -> None:
        problem = check(pending, drafts, accepted)
        if problem is not None:
            raise InvalidEvent(sequence, Event(event), problem)

    validator.__name__ = f"check_{event}"
    return validator


def build_oracle_class(spec: LifecycleSpec = SPEC, name: str = "LifecycleOracle") -> type[StateMachine]:
    """Compile a lifecycle spec into a python-statemachine `StateMachine` subclass: the
    generic compiler (melix_fsm.machine.build_oracle) with the lifecycle's guard meanings,
    payload validators and its rule that every state reaches `finished`."""
    conditions = {g: _condition(g) for g in spec.guards}
    validators = {e: _validator(e) for e in spec.events}
    return build_oracle(spec, name, conditions=conditions, validators=validators, final_reachable=True)


LifecycleOracle: type[StateMachine] = build_oracle_class()


def OracleMachine(state: State | str | None = None) -> StateMachine:  # noqa: N802 (a factory)
    """A fresh oracle instance, in the initial state or in `state`."""
    if state is None or state == SPEC.initial:
        return LifecycleOracle()
    return LifecycleOracle(start_value=str(state))


def oracle_state(machine: StateMachine) -> State:
    """The oracle's current state as a runtime `State`."""
    return State(machine.current_state_value)


def oracle_send(machine: StateMachine, signal: Signal, pending: int, sequence: Any = None) -> State:
    """Send `signal` to an oracle instance; raises TransitionNotAllowed or InvalidEvent."""
    machine.send(
        str(signal.event),
        pending=pending,
        drafts=signal.drafts,
        accepted=signal.accepted,
        sequence=sequence,
    )
    return oracle_state(machine)


def oracle_outcome(state: State | str, signal: Signal, pending: int) -> State | Refusal:
    """The state the oracle reaches from `state` on `signal`, or why it refused."""
    machine = OracleMachine(state)
    try:
        return oracle_send(machine, signal, pending)
    except TransitionNotAllowed:
        return Refusal.ILLEGAL
    except InvalidEvent:
        return Refusal.INVALID


def oracle_target(state: State | str, signal: Signal, pending: int) -> State | None:
    """The state the oracle reaches from `state` on `signal`; None when it refuses."""
    outcome = oracle_outcome(state, signal, pending)
    return None if isinstance(outcome, Refusal) else outcome
