"""The controller's actions drive a real `Batch` through legal suspend / resume events."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from melix_fsm.batch import Batch
from melix_fsm.lifecycle import ADMIT, PLAIN_STEP, VERIFY, draft, verified
from melix_fsm.policy import Action, ActivationController, decide

from .conftest import BANDWIDTH_BOUND, PRIOR

K = BANDWIDTH_BOUND.k


# Phases of constant acceptance: long collapses trigger suspensions and probes.
_phases = st.lists(st.tuples(st.integers(0, K), st.integers(1, 150)), min_size=1, max_size=8)


@given(_phases, st.integers(1, 3))
@example([(2, 40), (0, 200), (1, 300)], 2)  # collapse, failed probe, recovery
def test_actions_are_legal_lifecycle_events_and_counters_agree(phases, rows):
    accepted_per_row = [a for a, length in phases for _ in range(length)]
    decision = decide(BANDWIDTH_BOUND, "auto", PRIOR)
    assert decision.speculate
    uids = list(range(rows))
    batch = Batch(uids)
    batch.resolve({uid: ADMIT for uid in uids})
    ctrl = ActivationController(BANDWIDTH_BOUND, prior=PRIOR)
    for a in accepted_per_row:
        if ctrl.speculating:
            batch.step({uid: [draft(K), VERIFY, verified(a)] for uid in uids})
            action = ctrl.update(rows, a * rows, K * rows)
        else:
            batch.step({uid: PLAIN_STEP for uid in uids})
            action = ctrl.update(rows)
        if action is Action.suspend:
            batch.suspend(reason=ctrl.events[-1].reason)
        elif action is Action.resume:
            batch.resume(reason=ctrl.events[-1].reason)
    c, totals = ctrl.counters, batch.totals()
    assert totals.suspensions == rows * (c.suspend_decisions + c.probes_failed)
    assert totals.resumptions == rows * (c.resume_decisions - c.probes_passed + c.probes)
    assert totals.suspended_steps == rows * c.steps_suspended
