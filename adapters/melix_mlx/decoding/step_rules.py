"""The rules of one decode step that both decoders follow, written once.

melix_mlx.decode (one sequence, B = 1) and melix_mlx.batch_generator (B rows) drive the
same step pipeline (melix_mlx.decoding.step_driver) over the same cycle engine; what a settled
step means for the lifecycle, what a fault records, what the live controller is fed and
which rows its verdict suspends or resumes are the same rules at any B, so they live
here and the pipeline calls them. What differs stays with each decoder: admission and
emission (the batch), the quantized-KV boundary and the single-sequence cache form (one
sequence).

Rules of this module:
- Pure functions over lifecycle values (melix_fsm.lifecycle): no mlx, no engine, no clock.
- A step's lifecycle events for a row are `step_signals`: a cycle is draft, verify,
  verified (in that order, never emitted before verified); a plain step is plain_step.
- A fault records the drafts that existed (draft, verify), then the fault with its
  message: `fault_signals`.
- A step launched ahead (built on the lazy outcome of the one before it) is kept only if
  it still fits the plans the rows would get now (`ahead_fits`); otherwise the decoder
  undoes it and launches again.
- The controller is fed the batch's summed verify outcome with per-position counts
  (`verify_outcome`, `feed`), and its verdict, not the action it returned, is the truth:
  `steer` picks the rows to suspend (cycle-ready rows under a plain verdict) or resume
  (suspended rows under a speculating one, except rows whose plain step runs ahead: they
  settle it as the suspended window's last step and resume after it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from melix_fsm import lifecycle as lc
from melix_fsm.lifecycle import Event, Signal, State


def step_signals(k: int, accepted: int) -> list[Signal]:
    """One row's lifecycle events for a settled step: a cycle of k drafts, or a plain step."""
    if k == 0:
        return [lc.PLAIN_STEP]
    return [lc.draft(k), lc.VERIFY, lc.verified(accepted)]


def fault_signals(k: int, drafted: bool, message: str) -> tuple[list[Signal], Signal]:
    """(the step events a faulted cycle still records, the fault itself): the drafts that
    existed are recorded, then discarded with the fault."""
    before = [lc.draft(k), lc.VERIFY] if drafted else []
    return before, Signal(event=lc.FAULT.event, reason=message)


def cycle_depth(k: int, remaining: int) -> int:
    """Drafts of a row's next cycle (>= 1): k, and at most one fewer than the tokens the
    row may still emit (a cycle's bonus token is its last)."""
    return max(1, min(k, remaining - 1))


def may_build_on(step_is_cycle: bool, run_ahead: bool, engine: Any) -> bool:
    """May step n + 1 be built on step n's lazy outcome? After a plain step (mlx-lm's own
    pipelining) unless a cache waits for a quiet moment to be compacted (a window that
    plain steps grew: melix_mlx.runtime.window_batch); after a cycle only with run-ahead
    on and the cycle's rollback in the graph (`CycleEngine.may_run_ahead`)."""
    if not step_is_cycle:
        return not engine.compaction_due()
    return run_ahead and engine.may_run_ahead()


def may_launch_cycle_ahead(run_ahead: bool, controller: Any) -> bool:
    """May a cycle be launched ahead? Only with run-ahead on (on a CPU a cycle launched
    ahead computes inside the period of the step before it), and not while the step
    before it may turn speculation off on schedule (`LiveController.plain_due`): that
    switch would undo it."""
    return run_ahead and not getattr(controller, "plain_due", False)


def ahead_fits(then: Sequence[int], now: Sequence[int], resuming: Sequence[bool]) -> bool:
    """Does a step launched ahead with drafts `then` per row still fit the drafts `now`
    (0: plain)? Each row must still speculate or not as it did, and draft no deeper than now
    allowed; a row's plain step may run on where the row resumes after it."""
    return len(then) == len(now) and all(
        (t == 0 and r) or ((n > 0) == (t > 0) and t <= n) for t, n, r in zip(then, now, resuming)
    )


def verify_outcome(rows: Iterable[Sequence[Signal]]) -> tuple[int, int, list[int]]:
    """(accepted, proposed, accepted per draft position) summed over rows' step events."""
    accepted = proposed = 0
    positions: list[int] = []
    for signals in rows:
        for signal in signals:
            if signal.event is Event.draft:
                proposed += signal.drafts
                positions.extend([0] * (signal.drafts - len(positions)))
            elif signal.event is Event.verified:
                accepted += signal.accepted
                for j in range(signal.accepted):
                    positions[j] += 1
    return accepted, proposed, positions


def feed(
    controller: Any,
    batch_size: int,
    rows: Iterable[Sequence[Signal]],
    *,
    seconds: float | None,
    tokens: int,
    remaining: int | None,
    exclude: bool = False,
    priced_at: int | None = None,
) -> None:
    """Feed the live controller one step: its rows' verify outcome, wall time and worth
    (`tokens` priced at batch `priced_at`'s plain step: LiveController.update)."""
    accepted, proposed, positions = verify_outcome(rows)
    controller.update(
        batch_size,
        accepted,
        proposed,
        seconds=seconds,
        tokens=tokens,
        accepted_per_position=positions or None,
        exclude=exclude,
        remaining=remaining,
        priced_at=priced_at,
    )


def steer(controller: Any, states: Sequence[State], plain_ahead: Sequence[bool]) -> tuple[Signal, list[int]]:
    """The suspend or resume the controller's verdict asks for, and the rows (indices) it
    applies to; the reason is the controller's latest decision's."""
    events = controller.events
    if controller.speculating:
        rows = [i for i, s in enumerate(states) if s is State.suspended and not plain_ahead[i]]
        reason = str(events[-1].reason) if events else "speculating"
        return Signal(event=Event.resume, reason=reason), rows
    rows = [i for i, s in enumerate(states) if s in lc.CYCLE_READY]
    reason = str(events[-1].reason) if events else "suspended"
    return Signal(event=Event.suspend, reason=reason), rows
