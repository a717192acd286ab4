"""The runtime lifecycle machine of one sequence, compiled from spec/lifecycle.toml.

Rules of this module:
- The table is the truth. `TABLE[(state, event)]` is the target state, or a `Guarded`
  cell for the one (state, event) pair with disjoint guards; a missing key is illegal.
  No transition is written here: adding one means editing the spec file.
- What this module does own is the *effect* of each event on the row's counters and
  the *meaning* of each guard; the import fails if the spec names an event or guard
  that has no effect or meaning here, and vice versa.
- Every event is first planned (pure: nothing changes, errors raise) and then
  committed. An illegal event raises `IllegalTransition`, a bad payload `InvalidEvent`,
  and the machine is left exactly as it was. Batches rely on the split to apply a
  whole step atomically.
- No mlx, no caches, no scheduler: this is a sans-IO core.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from .counters import Counters
from .errors import IllegalTransition, InvalidEvent
from .machine import check_vocabulary
from .spec import LifecycleSpec, load_lifecycle

SPEC: LifecycleSpec = load_lifecycle()



class State(enum.StrEnum):
    """The lifecycle states (spec/lifecycle.toml [states]); checked against the spec at import."""

    requested = "requested"
    admitted = "admitted"
    refused = "refused"
    drafting = "drafting"
    verifying = "verifying"
    accepted = "accepted"
    rolled_back = "rolled_back"
    suspended = "suspended"
    faulted = "faulted"
    finished = "finished"


class Event(enum.StrEnum):
    """The lifecycle events (spec/lifecycle.toml [events]); checked against the spec at import."""

    admit = "admit"
    refuse = "refuse"
    draft = "draft"
    verify = "verify"
    verified = "verified"
    suspend = "suspend"
    resume = "resume"
    plain_step = "plain_step"
    fault = "fault"
    finish = "finish"


check_vocabulary(SPEC, State, Event)  # the spec is the truth: a difference fails the import

INITIAL: State = State(SPEC.initial)
FINAL_STATES: frozenset[State] = frozenset(State(n) for n in SPEC.finals)


class Signal(msgspec.Struct, frozen=True, kw_only=True):
    """One lifecycle event with its payload, as generators report it.

    drafts: for `draft`, how many tokens the head proposed (>= 1).
    accepted: for `verified`, how many pending drafts the verify accepted.
    reason: free text for suspend / resume / fault / finish / refuse.
    """

    event: Event
    drafts: int = 0
    accepted: int = 0
    reason: str = ""


GuardFn = Callable[[int, int, int], bool]  # (pending, drafts, accepted) -> bool

# What each guard named in the spec means.
GUARDS: dict[str, GuardFn] = {
    "all_accepted": lambda pending, drafts, accepted: accepted == pending,
}


class Guarded(NamedTuple):
    """A (state, event) cell split by a guard into two targets."""

    guard: GuardFn
    guard_name: str
    if_true: State
    if_false: State


def _compile(spec: LifecycleSpec) -> dict[tuple[State, Event], State | Guarded]:
    named = {t.guard for t in spec.transitions if t.guard}
    if named - set(GUARDS):
        raise RuntimeError(f"guards named in the spec without a meaning: {sorted(named - set(GUARDS))}")
    if set(GUARDS) - named:
        raise RuntimeError(f"guards with a meaning the spec never names: {sorted(set(GUARDS) - named)}")
    table: dict[tuple[State, Event], Any] = {}
    for t in spec.transitions:
        key = (State(t.source), Event(t.event))
        target = State(t.target)
        if t.guard is None:
            table[key] = target
            continue
        cell = table.get(key) or Guarded(GUARDS[t.guard], t.guard, target, target)
        if t.negated:
            cell = cell._replace(if_false=target)
        else:
            cell = cell._replace(if_true=target)
        table[key] = cell
    return table


TABLE: dict[tuple[State, Event], State | Guarded] = _compile(SPEC)

# Per-event payload checks: return a problem description, or None when the payload is fine.
_Check = Callable[[int, int, int], "str | None"]


def _check_draft(pending: int, drafts: int, accepted: int) -> str | None:
    return None if drafts >= 1 else f"a draft proposes at least one token, got {drafts}"


def _check_verified(pending: int, drafts: int, accepted: int) -> str | None:
    if 0 <= accepted <= pending:
        return None
    return f"accepted must be between 0 and the {pending} pending drafts, got {accepted}"


CHECKS: dict[Event, _Check] = {Event.draft: _check_draft, Event.verified: _check_verified}


def _effect_draft(c: Counters, state: State, signal: Signal) -> None:
    k = signal.drafts
    c.pending = k
    c.proposed += k
    _bump(c.position_proposed, k)


def _effect_verified(c: Counters, state: State, signal: Signal) -> None:
    a = signal.accepted
    c.accepted += a
    c.rejected += c.pending - a
    c.rollbacks += a < c.pending
    c.cycles += 1
    c.emitted += a + 1  # accepted drafts plus the bonus token from the verify forward
    _bump(c.position_accepted, a)
    c.pending = 0


def _effect_plain_step(c: Counters, state: State, signal: Signal) -> None:
    c.plain_steps += 1
    c.emitted += 1
    if state is _SUSPENDED:
        c.suspended_steps += 1


def _effect_suspend(c: Counters, state: State, signal: Signal) -> None:
    c.suspensions += 1


def _effect_resume(c: Counters, state: State, signal: Signal) -> None:
    c.resumptions += 1


def _effect_fault(c: Counters, state: State, signal: Signal) -> None:
    c.faults += 1
    c.discarded += c.pending
    c.pending = 0


def _effect_finish(c: Counters, state: State, signal: Signal) -> None:
    c.discarded += c.pending
    c.pending = 0


def _no_effect(c: Counters, state: State, signal: Signal) -> None:
    return None


def _bump(counts: list[int], upto: int) -> None:
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for p in range(upto):
        counts[p] += 1


_SUSPENDED = State.suspended
EFFECTS: dict[Event, Callable[[Counters, State, Signal], None]] = {
    Event.admit: _no_effect,
    Event.refuse: _no_effect,
    Event.draft: _effect_draft,
    Event.verify: _no_effect,
    Event.verified: _effect_verified,
    Event.suspend: _effect_suspend,
    Event.resume: _effect_resume,
    Event.plain_step: _effect_plain_step,
    Event.fault: _effect_fault,
    Event.finish: _effect_finish,
}
if set(EFFECTS) != set(Event):
    raise RuntimeError(f"events without an effect: {sorted(set(Event) - set(EFFECTS))}")


def target_of(sequence: Any, state: State, pending: int, signal: Signal) -> State:
    """Plan one event: the state it leads to, or a typed error. Changes nothing."""
    event = signal.event
    cell = TABLE.get((state, event))
    if cell is None:
        raise IllegalTransition(sequence, state, event)
    check = CHECKS.get(event)
    if check is not None:
        problem = check(pending, signal.drafts, signal.accepted)
        if problem is not None:
            raise InvalidEvent(sequence, event, problem)
    if type(cell) is Guarded:
        return cell.if_true if cell.guard(pending, signal.drafts, signal.accepted) else cell.if_false
    return cell  # type: ignore[return-value]


def pending_after(pending: int, signal: Signal) -> int:
    """How many drafts are pending after this event (used to plan event sequences).

    Derived from the event's effect on a scratch copy of the counters, so the planner
    and the machine can never disagree.
    """
    scratch = Counters(pending=pending)
    EFFECTS[signal.event](scratch, INITIAL, signal)
    return scratch.pending


class SequenceMachine:
    """The lifecycle of one sequence: its state, its counters, nothing else."""

    __slots__ = ("uid", "state", "counters")

    def __init__(self, uid: Any, state: State = INITIAL, counters: Counters | None = None) -> None:
        self.uid = uid
        self.state = state
        self.counters = counters if counters is not None else Counters()

    def __repr__(self) -> str:
        return f"SequenceMachine(uid={self.uid!r}, state={self.state.value})"

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def pending(self) -> int:
        return self.counters.pending

    def plan(self, signal: Signal) -> State:
        """The state `signal` would lead to; raises like `send` but changes nothing."""
        return target_of(self.uid, self.state, self.counters.pending, signal)

    def commit(self, signal: Signal, target: State) -> None:
        """Apply a planned event. Only call with the target `plan` returned."""
        EFFECTS[signal.event](self.counters, self.state, signal)
        self.state = target

    def send(self, signal: Signal) -> State:
        """Plan and commit one event; return the new state."""
        target = target_of(self.uid, self.state, self.counters.pending, signal)
        EFFECTS[signal.event](self.counters, self.state, signal)
        self.state = target
        return target

    def allows(self, event: Event) -> bool:
        """Whether the table has any transition for `event` in the current state."""
        return (self.state, event) in TABLE


def legal_events(state: State) -> list[Event]:
    """The events the table accepts in `state`, in spec order."""
    return [e for e in Event if (state, e) in TABLE]


def states_allowing(event: Event) -> frozenset[State]:
    """Every state in which the table accepts `event` (state predicates come from the spec)."""
    return frozenset(state for state, e in TABLE if e is event)


# Step-boundary predicates the decoders use, derived from the table, never re-typed:
CYCLE_READY = states_allowing(Event.draft)  # the next step may speculate
STEERABLE = states_allowing(Event.suspend) | states_allowing(Event.resume)  # policy applies
IN_CYCLE = states_allowing(Event.verify) | states_allowing(Event.verified)  # drafts pending


# Ready-made payload-free signals for the hot path (Signal is immutable, so sharing is safe).
ADMIT = Signal(event=Event.admit)
REFUSE = Signal(event=Event.refuse)
VERIFY = Signal(event=Event.verify)
SUSPEND = Signal(event=Event.suspend)
RESUME = Signal(event=Event.resume)
PLAIN_STEP = Signal(event=Event.plain_step)
FAULT = Signal(event=Event.fault)
FINISH = Signal(event=Event.finish)


def draft(k: int) -> Signal:
    return Signal(event=Event.draft, drafts=k)


def verified(accepted: int) -> Signal:
    return Signal(event=Event.verified, accepted=accepted)
