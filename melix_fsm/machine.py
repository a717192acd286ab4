"""Compile any machine of spec/ into a table-driven runtime, and into a test oracle.

The lifecycle (melix_fsm.lifecycle) has its own compiled table because its events carry
payloads and counter effects on a per-token hot path. Every other machine (the live
controller's mode, the depth chooser, a step's flight through the pipeline, a served
request) is compiled here, the same way:

- The table is the truth: `CompiledMachine.table[(state, event)]` is the target state, or
  a `GuardedCell` split by a named guard; a missing key is illegal and raises
  `IllegalTransition`. No transition is written in code.
- The vocabulary is checked at import: the owner's `State` / `Event` enums must list
  exactly the spec's names in the spec's order, and the owner names the guards it gives a
  meaning to (their numeric rules stay in code, as `all_accepted` does for the lifecycle).
- Every event goes through one method, `Tracker.send` (h11's `_process_event`): it looks
  up the cell, evaluates the cell's guard from the values the caller passes, moves the
  state and appends a `Step` to the history. On an illegal event the state is unchanged.
- `build_oracle` compiles the same spec into a python-statemachine `StateMachine` (never a
  `StateChart`, which silently ignores unknown events): the independent second compilation
  that stateful suites hold the runtime against. Guards are passed to the oracle as
  booleans by name, so both sides decide from the same guard values.
- Sans-IO: no clock, no mlx; ~1 us a transition.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

from .errors import IllegalTransition, LifecycleError
from .spec import MachineSpec

S = TypeVar("S", bound=enum.StrEnum)
E = TypeVar("E", bound=enum.StrEnum)


class MissingGuard(LifecycleError):
    """A guarded cell was reached without a value for its guard."""

    def __init__(self, machine: str, state: Any, event: Any, guard: str) -> None:
        self.machine, self.state, self.event, self.guard = machine, state, event, guard
        super().__init__(f"{machine}: ({state}, {event}) needs the guard {guard!r}")


class GuardedCell(NamedTuple):
    """A (state, event) cell split by a named guard into two targets."""

    guard: str
    if_true: Any
    if_false: Any


class Step(NamedTuple):
    """One recorded transition of a tracked machine."""

    source: str
    event: str
    target: str
    guard: str | None = None  # the guard's label as taken ("g" or "!g"), when the cell had one
    reason: str = ""


def check_vocabulary(spec: MachineSpec, states: type[enum.StrEnum], events: type[enum.StrEnum]) -> None:
    """The owner's enums list exactly the spec's states and events, in the spec's order.

    Owners write their members out so a type checker sees them; the spec stays the truth,
    so any difference (a state added in the spec, a member renamed in code) fails the import.
    """
    for kind, members, declared in (("state", states, spec.states), ("event", events, spec.events)):
        ours, theirs = [m.value for m in members], list(declared)
        if ours != theirs:
            raise RuntimeError(
                f"{spec.name} {kind}s differ from the spec (same names, same order): "
                f"code {ours}, spec {theirs}"
            )


class CompiledMachine(Generic[S, E]):
    """A machine spec compiled against its owner's vocabulary (enums and guard names)."""

    def __init__(self, spec: MachineSpec, states: type[S], events: type[E], guards: frozenset[str]) -> None:
        check_vocabulary(spec, states, events)
        named = set(spec.guards)
        if named != set(guards):
            raise RuntimeError(
                f"{spec.name} guards: the spec names {sorted(named)}, "
                f"the code gives meaning to {sorted(guards)}"
            )
        self.spec = spec
        self.name = spec.name
        self.states = states
        self.events = events
        self.initial: S = states(spec.initial)
        self.finals: frozenset[S] = frozenset(states(n) for n in spec.finals)
        table: dict[tuple[S, E], S | GuardedCell] = {}
        for t in spec.transitions:
            key = (states(t.source), events(t.event))
            target = states(t.target)
            if t.guard is None:
                table[key] = target
                continue
            cell = table.get(key)
            cell = cell if isinstance(cell, GuardedCell) else GuardedCell(t.guard, target, target)
            table[key] = cell._replace(if_false=target) if t.negated else cell._replace(if_true=target)
        self.table = table

    def target(self, state: S, event: E, guards: Mapping[str, bool] | None = None) -> S:
        """The state `event` leads to from `state`; raises IllegalTransition / MissingGuard."""
        return self.step(state, event, guards)[0]

    def step(self, state: S, event: E, guards: Mapping[str, bool] | None = None) -> tuple[S, str | None]:
        """(target, the guard label taken: "g", "!g" or None) in one table lookup."""
        cell = self.table.get((state, event))
        if cell is None:
            raise IllegalTransition(self.name, state, event) from None
        if isinstance(cell, GuardedCell):
            if guards is None or cell.guard not in guards:
                raise MissingGuard(self.name, state, event, cell.guard)
            if guards[cell.guard]:
                return cell.if_true, cell.guard
            return cell.if_false, "!" + cell.guard
        return cell, None

    def allows(self, state: S, event: E) -> bool:
        return (state, event) in self.table

    def tracker(self, state: S | None = None) -> Tracker[S, E]:
        return Tracker(self, self.initial if state is None else state)


@dataclass
class Tracker(Generic[S, E]):
    """One live instance of a compiled machine: its state and the history of its steps."""

    machine: CompiledMachine[S, E]
    state: S
    history: list[Step] = field(default_factory=list)
    keep_history: int = 256  # at least the newest steps kept (at most twice as many)
    sent: int = 0  # events processed over the tracker's life (history keeps the newest)

    def send(self, event: E, reason: str = "", **guards: bool) -> S:
        """Process one event: the only way this tracker's state changes."""
        source = self.state
        target, label = self.machine.step(source, event, guards)
        self.state = target
        self.sent += 1
        history = self.history
        history.append(Step(source.value, event.value, target.value, label, str(reason)))
        if len(history) > 2 * self.keep_history:  # trimmed in halves: amortised O(1) a step
            del history[: len(history) - self.keep_history]
        return target

    def allows(self, event: E) -> bool:
        return self.machine.allows(self.state, event)

    @property
    def is_final(self) -> bool:
        return self.state in self.machine.finals


def build_oracle(
    spec: MachineSpec,
    class_name: str | None = None,
    *,
    conditions: Mapping[str, Any] | None = None,
    validators: Mapping[str, Any] | None = None,
    final_reachable: bool = False,
) -> type:
    """Compile `spec` into a python-statemachine `StateMachine` subclass (the test oracle).

    Send events as `oracle.send(event, **guards)`: by default a guarded transition reads
    its guard's boolean from the keyword of the same name; `conditions` gives a guard
    another meaning (a callable of the send keywords), `validators` an event's payload
    check. A missing transition raises python-statemachine's `TransitionNotAllowed`.
    `final_reachable`: also require every state to reach a final one (the lifecycle's
    rule; machines that loop for their owner's life, like the controller, do not).
    """
    # Lazy: python-statemachine costs ~100 ms to import and is for tests and diagrams only.
    from statemachine import State as SMState
    from statemachine import StateMachine
    from statemachine.factory import StateMachineMetaclass

    states = {
        s.name: SMState(name=s.name, value=s.name, initial=s.name == spec.initial, final=s.final)
        for s in spec.states.values()
    }
    conditions = {g: (conditions or {}).get(g) or _condition(g) for g in spec.guards}
    events: dict[str, Any] = {}
    for t in spec.transitions:
        kwargs: dict[str, Any] = {"event": t.event}
        if t.guard is not None:
            kwargs["unless" if t.negated else "cond"] = conditions[t.guard]
        if validators and validators.get(t.event) is not None:
            kwargs["validators"] = validators[t.event]
        transitions = states[t.source].to(states[t.target], **kwargs)
        events[t.event] = events[t.event] | transitions if t.event in events else transitions
    name = class_name or "".join(p.title() for p in spec.name.split("_")) + "Oracle"
    attrs: dict[str, Any] = {
        "__module__": __name__,
        "__doc__": f"python-statemachine oracle compiled from {spec.path}.",
        "validate_final_reachability": final_reachable,
        **states,
        **events,
    }
    return StateMachineMetaclass(name, (StateMachine,), attrs)


def _condition(guard: str) -> Any:
    # python-statemachine injects send() keyword arguments by parameter name; **kw gets them all.
    def condition(**kwargs: Any) -> bool:
        if guard not in kwargs:
            raise MissingGuard("oracle", "?", "?", guard)
        return bool(kwargs[guard])

    condition.__name__ = guard
    return condition
