"""The live controller's actions drive a real `Batch` through legal suspend / resume events."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from melix_fsm.batch import Batch
from melix_fsm.lifecycle import ADMIT, CYCLE_READY, PLAIN_STEP, VERIFY, State, draft, verified
from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.decision import decide
from melix_fsm.policy.live_types import Action

from .conftest import BANDWIDTH_BOUND, PRIOR

K = BANDWIDTH_BOUND.k


# Phases of constant acceptance: long collapses trigger suspensions and probes.
_phases = st.lists(st.tuples(st.integers(0, K), st.integers(1, 150)), min_size=1, max_size=8)


@given(_phases, st.integers(1, 3))
@example([(2, 40), (0, 200), (1, 300)], 2)  # collapse, failed probe, recovery
def test_actions_are_legal_lifecycle_events_and_counters_agree(phases, rows):
    """Fed no seconds (the cost model alone decides), every action the controller returns is
    a lifecycle event the rows accept at the cycle boundary, and its verdict is the rows'."""
    accepted_per_row = [a for a, length in phases for _ in range(length)]
    decision = decide(BANDWIDTH_BOUND, "auto", PRIOR)
    assert decision.speculate
    uids = list(range(rows))
    batch = Batch(uids)
    batch.resolve({uid: ADMIT for uid in uids})
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR, depth=K, batch_size=rows)
    suspends = resumes = plain_steps_suspended = 0
    if not ctrl.speculating:  # the prior may start plain (e.g. at a batch size never calibrated):
        batch.suspend(reason=ctrl.events[-1].reason)  # the decoders follow the verdict at start
        suspends += 1
    for a in accepted_per_row:
        speculating = ctrl.speculating
        states = {row.state for row in batch}
        assert states <= (CYCLE_READY if speculating else {State.suspended})  # verdict == rows
        if speculating:
            batch.step({uid: [draft(K), VERIFY, verified(a)] for uid in uids})
            action = ctrl.update(rows, a * rows, K * rows)
        else:
            batch.step({uid: PLAIN_STEP for uid in uids})
            plain_steps_suspended += 1
            action = ctrl.update(rows)
        if action is Action.suspend:
            assert batch.suspend(reason=ctrl.events[-1].reason) == uids  # legal for every row
            suspends += 1
        elif action is Action.resume:
            assert batch.resume(reason=ctrl.events[-1].reason) == uids
            resumes += 1
    totals = ctrl.counters, batch.totals()
    assert totals[1].suspensions == rows * suspends and totals[1].resumptions == rows * resumes
    assert totals[1].suspended_steps == rows * plain_steps_suspended
    assert ctrl.counters.steps == len(accepted_per_row)
