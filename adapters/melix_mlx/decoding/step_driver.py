"""The one step pipeline of both decoders: plan -> launch -> run ahead -> validate ->
settle -> lifecycle events -> policy feedback, for B rows of the cycle engine.

melix_mlx.batch_generator (B rows, with admission and emission around it) and
melix_mlx.decode (one sequence: the B = 1 client, as mlx-lm's single-sequence functions
sit over its batch objects) both decode through `StepPipeline`; neither runs a step of
its own. The rules a step follows are melix_mlx.decoding.step_rules'.

Rules of this module:
- The pipeline owns no row records: a client (`StepRows`) says which rows decode (their
  ids, in engine order), their lifecycle states, each row's plan for the next step, and
  whether a step may be planned ahead of it; the pipeline sends every lifecycle event it
  causes back through the client's one funnel (`apply_signals`).
- There is one run-ahead state: `ahead`, the next step, launched before it was due. A
  launched step carries its own plans and rows' ids (melix_mlx.runtime.engine_records), so
  nothing about it is kept beside it.
- `step` settles one step: the one launched ahead, or one launched now. Step n + 1 is
  launched before step n syncs when `may_build_on` / `may_launch_cycle_ahead` and the
  client allow; a fault met while building it is recorded after step n's events and
  emission (`record_ahead_fault`: the lifecycle sees events in step order). A cycle that
  faults (building or settling) faults the rows that speculated in it; they continue
  plainly and no token was emitted by it.
- A step launched ahead is kept only while it fits the plans the rows would get now
  (`check_ahead`, melix_mlx.decoding.step_rules.ahead_fits); otherwise it is undone.
- The controller's verdict becomes suspend / resume events (`reconcile`); a row whose
  plain step runs ahead resumes after it (melix_mlx.decoding.step_rules.steer).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from melix_fsm.batch import Operation
from melix_fsm.lifecycle import Signal, State

from ..runtime.engine import CycleEngine
from ..runtime.engine_records import Flight, PlainStep, RowPlan, Settled, SpeculativeFault
from . import step_rules

Signals = dict[Any, Signal | list[Signal]]


def run_ahead_default() -> bool:
    """Whether decoders build step n + 1 before syncing step n, unless told otherwise.

    On a GPU the host builds while the device computes. On a CPU, mlx's evaluation keeps
    the host thread dispatching until at most ~100 kernels are left (MAX_ACTIVE_TASKS = 10
    tasks of DISPATCHES_PER_TASK = 10, compile-time constants of mlx), and the building
    competes with the compute for the same cores: measured slower on this project's CPU
    benchmarks (BENCHMARKS.md, "Run-ahead"), so it is off there. What that serial host
    time costs mlx-lm's own loop: benchmarks/bench_cpu_dispatch.py ("Ninth round").
    """
    return mx.default_device().type == mx.DeviceType.gpu


class StepRows(Protocol):
    """What a decoder's rows tell the step pipeline."""

    def step_uids(self) -> list[Any]:
        """The decoding rows' ids, in engine order."""
        ...

    def step_states(self) -> list[State]:
        """The decoding rows' lifecycle states, in engine order."""
        ...

    def plan_step(self, before: list[RowPlan] | None) -> list[RowPlan]:
        """Each row's plan for the next step; `before`: the plans of a step not yet settled."""
        ...

    def may_plan_ahead(self, plans: list[RowPlan]) -> bool:
        """May the step after one with these plans be launched before it settles?"""
        ...

    def apply_signals(self, operation: Operation, signals: Signals) -> None:
        """Send lifecycle events (a batch operation, atomic) and record them."""
        ...


@dataclass
class StepOutcome:
    """One settled step: what each row went through and emitted."""

    uids: list[Any]
    plans: list[RowPlan]
    settled: Settled  # a plain step reads as a cycle of 0 drafts per row
    signals: dict[Any, list[Signal]] = field(default_factory=dict)  # the step's events per row


class StepPipeline:
    """Plan, launch, run ahead, validate, settle and steer steps of B rows; see the module rules."""

    def __init__(self, engine: CycleEngine, rows: StepRows, controller: Any, run_ahead: bool) -> None:
        self.engine = engine
        self.rows = rows
        self.controller = controller  # melix_fsm.policy.controller.LiveController, or None
        self.run_ahead = run_ahead
        self.ahead: Flight | PlainStep | None = None  # the next step, launched before it was due
        self._ahead_fault: tuple[SpeculativeFault, list[tuple[Any, int]]] | None = None
        self._last_step_end: float | None = None

    # -- one step ----------------------------------------------------------------------
    def step(self) -> StepOutcome | None:
        """Settle the next step (launched ahead, or launched now) and send its events.

        None when its cycle faulted (the faulted rows continue plainly; no token came).
        """
        step, self.ahead = self.ahead, None
        if step is None:
            self.reconcile()  # nothing runs ahead now: a resume put off for a plain step applies
            step = self.launch(self.rows.plan_step(None))
            if step is None:
                return None
        try:
            following = self._plans_ahead(step)
            if following is not None:  # step n + 1 is built before step n is synced
                self._launch_ahead(following, step.uids)
            outcome = self._settle(step)
        except BaseException:
            with contextlib.suppress(RuntimeError):  # a plain step across a reshape only settles
                self.engine.abandon(step)  # undoing it voids the step built on it
            self.ahead = None
            raise
        if outcome is not None:
            self.rows.apply_signals(Operation.step, dict(outcome.signals))
        return outcome

    def launch(self, plans: list[RowPlan]) -> Flight | PlainStep | None:
        """Launch a step of the rows as they are now; None when its cycle faulted while
        building (the rows that speculated are faulted)."""
        uids = self.rows.step_uids()
        if not any(p.k for p in plans):
            return self._started(self.engine.plain(plans, uids))
        try:
            return self.engine.launch(plans, uids)
        except SpeculativeFault as fault:  # the rows continue plainly; no token was emitted
            self.fault_rows([(uid, p.k) for uid, p in zip(uids, plans) if p.k > 0], fault)
            return None

    def launch_next(self, *, cycle_waits: bool = False) -> None:
        """Launch the next step now (unless one runs ahead), so the device computes it
        while the caller handles this step's tokens; `cycle_waits`: a cycle is not
        launched early (only a plain step, mlx-lm's own pipelining)."""
        if self.ahead is not None:
            return
        self.reconcile()  # nothing runs ahead now: a resume put off for a plain step applies
        plans = self.rows.plan_step(None)
        if cycle_waits and any(p.k for p in plans):
            return
        self.ahead = self.launch(plans)

    def _plans_ahead(self, step: Flight | PlainStep) -> list[RowPlan] | None:
        """The plans of step n + 1 if it may be launched before `step` settles, else None.

        Without `run_ahead` only a plain step after a plain step (mlx-lm's own pipelining);
        with it, anything after a plain step, and after a cycle whose rollback runs in the
        graph, but no cycle while `step`'s update may turn speculation off on schedule."""
        if not self.rows.may_plan_ahead(step.plans):
            return None
        cycle = isinstance(step, Flight)
        if not step_rules.may_build_on(cycle, self.run_ahead, self.engine):
            return None
        following = self.rows.plan_step(step.plans)
        cycle_ahead = any(p.k for p in following)
        if cycle_ahead and not step_rules.may_launch_cycle_ahead(self.run_ahead, self.controller):
            return None  # a cycle the schedule's switch to plain would undo, or no run-ahead
        return following

    def _launch_ahead(self, plans: list[RowPlan], uids: list[Any]) -> None:
        """Launch step n + 1; a fault while building it is recorded after step n's events."""
        try:
            if any(p.k for p in plans):
                self.ahead = self.engine.launch(plans, uids)
            else:
                self.ahead = self._started(self.engine.plain(plans, uids))
        except SpeculativeFault as fault:
            self._ahead_fault = (fault, [(uid, p.k) for uid, p in zip(uids, plans) if p.k > 0])

    @staticmethod
    def _started(step: PlainStep) -> PlainStep:
        mx.async_eval(step.tokens)
        return step

    def _settle(self, step: Flight | PlainStep) -> StepOutcome | None:
        """Sync `step`; None when its cycle faulted (the rows that speculated are faulted)."""
        if isinstance(step, PlainStep):
            tokens = self.engine.settle_plain(step)
            B = len(tokens)
            settled = Settled([0] * B, [[t] for t in tokens], step.logprobs[:, None], [[]] * B, [0] * B)
        else:
            try:
                settled = self.engine.settle(step)
            except SpeculativeFault as fault:
                self.ahead = self._ahead_fault = None  # undoing the cycle voided the step built on it
                self.fault_rows([(uid, p.k) for uid, p in zip(step.uids, step.plans) if p.k > 0], fault)
                return None
        signals = {
            uid: step_rules.step_signals(plan.k, a)
            for uid, plan, a in zip(step.uids, step.plans, settled.accepted)
        }
        return StepOutcome(list(step.uids), list(step.plans), settled, signals)

    def record_ahead_fault(self) -> None:
        """Record a fault met while launching a step ahead, for the rows still decoding.
        The client calls it once the step before is done with (its tokens emitted, its
        rows left): the lifecycle sees events in step order."""
        if self._ahead_fault is None:
            return
        fault, rows = self._ahead_fault
        self._ahead_fault = None
        here = set(self.rows.step_uids())
        if any(uid in here for uid, _ in rows):
            self.fault_rows([(uid, k) for uid, k in rows if uid in here], fault)

    def fault_rows(self, rows: list[tuple[Any, int]], fault: SpeculativeFault) -> None:
        """Fault rows (uid, drafts) for good: their drafts that existed are recorded, then
        the fault; their heads do no more work."""
        message = str(fault)
        outcome = {uid: step_rules.fault_signals(k, fault.drafted, message) for uid, k in rows}
        recorded = {uid: before for uid, (before, _) in outcome.items() if before}
        if recorded:  # the drafts existed: record them, then discard them with the fault
            self.rows.apply_signals(Operation.step, dict(recorded))
        self.rows.apply_signals(Operation.fault, {uid: signal for uid, (_, signal) in outcome.items()})
        faulted = {uid for uid, _ in rows}
        for uid, head in zip(self.rows.step_uids(), self.engine.rows):
            if uid in faulted:
                self.engine.forget(head)

    # -- the step launched ahead ---------------------------------------------------------
    def check_ahead(self) -> bool:
        """Keep the step launched ahead only if it still fits: the same rows, each
        speculating or not as the lifecycle and the policy now say, none deeper than now
        allowed. Otherwise it is undone (True) and launched again when due."""
        step = self.ahead
        if step is None:
            return False
        uids = self.rows.step_uids()
        fresh = self.rows.plan_step(None) if uids else []
        resuming = [self.resuming(state) for state in self.rows.step_states()]
        then, now = [p.k for p in step.plans], [p.k for p in fresh]
        if uids == step.uids and step_rules.ahead_fits(then, now, resuming):
            return False
        self.abandon_ahead()
        self.reconcile()  # a resume put off for the step just undone applies now
        return True

    def abandon_ahead(self) -> None:
        """Undo the step launched ahead (the consumer stopped, or rows leave)."""
        if self.ahead is not None:
            step, self.ahead = self.ahead, None
            self.engine.abandon(step)

    def drop_cycle_ahead(self) -> None:
        """Undo a cycle launched ahead before rows are read or reshaped (a plain step stays:
        it narrows with a filter)."""
        if isinstance(self.ahead, Flight):
            self.abandon_ahead()

    def filter(self, keep: list[int]) -> None:
        """Keep engine rows `keep`; a plain step running ahead keeps the surviving rows."""
        self.drop_cycle_ahead()
        self.engine.filter(keep)
        if self.ahead is not None:  # the narrowed step carries the kept rows' plans and uids
            self.ahead = self.engine.in_flight[0] if keep else None

    # -- policy ------------------------------------------------------------------------
    def step_seconds(self) -> float | None:
        """Wall time since the previous step ended (None for the first): the step's period."""
        now = time.perf_counter()
        seconds = None if self._last_step_end is None else now - self._last_step_end
        self._last_step_end = now
        return seconds

    def feed(
        self,
        batch_size: int,
        signals: Iterable[Sequence[Signal]],
        *,
        seconds: float | None,
        tokens: int,
        remaining: int | None,
        exclude: bool = False,
        priced_at: int | None = None,
    ) -> None:
        """Feed the controller one step's outcome; its verdict becomes lifecycle events."""
        if self.controller is None:
            return
        step_rules.feed(
            self.controller,
            batch_size,
            signals,
            seconds=seconds,
            tokens=tokens,
            remaining=remaining,
            exclude=exclude,
            priced_at=priced_at,
        )
        self.reconcile()

    def resuming(self, state: State) -> bool:
        """A suspended row the controller speculates for again (it resumes at the next
        `reconcile` with no plain step of it running ahead)."""
        return self.controller is not None and self.controller.speculating and state is State.suspended

    def reconcile(self, uids: list[Any] | None = None, states: list[State] | None = None) -> None:
        """Bring rows' lifecycle (default: every decoding row's) in line with the
        controller's verdict. The verdict, not the returned action, is the truth: a window
        the controller calls plain is a suspended window for every row that could speculate."""
        if self.controller is None:
            return
        if uids is None or states is None:
            uids, states = self.rows.step_uids(), self.rows.step_states()
        # a plain step launched ahead belongs to the suspended window it was launched in:
        # its rows settle it as a plain step and resume after it, so the switch undoes nothing
        ahead = set(self.ahead.uids) if isinstance(self.ahead, PlainStep) else set()
        signal, picked = step_rules.steer(self.controller, states, [uid in ahead for uid in uids])
        if picked:
            self.rows.apply_signals(Operation(signal.event.value), {uids[i]: signal for i in picked})
