"""The start re-decided on the acceptance the starting prompts measured (`price_prompts`).

The prior is the family's greedy acceptance; sampled rows accept less. The decoders score
the sampled rows' prompts teacher-forced at their own settings and hand the figure to the
controller before the first step; these tests pin what the controller does with it.
"""

from __future__ import annotations

import pytest

from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.cost_model import AcceptancePrior, Timings
from melix_fsm.policy.depth import DepthReason
from melix_fsm.policy.errors import PolicyError
from melix_fsm.policy.live_types import Action, LiveReason
from melix_fsm.policy.modes import Mode, ModeEvent

from .conftest import BANDWIDTH_BOUND, COMPUTE_BOUND, PRIOR


def test_low_prompt_acceptance_suspends_a_start_the_prior_admitted() -> None:
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR)
    assert ctrl.state is Mode.on and ctrl.speculating
    assert ctrl.price_prompts(0.02, 1) is Action.suspend
    assert ctrl.state is Mode.suspended and not ctrl.speculating
    event = ctrl.events[-1]
    assert (event.action, event.reason) == (Action.suspend, LiveReason.prompt_acceptance)
    assert ctrl.mode.history[-1].event == ModeEvent.reprice
    summary = ctrl.summary()
    assert summary["prompt_acceptance"] == 0.02 and summary["per_position_acceptance"] == [0.02]


def test_high_prompt_acceptance_keeps_the_start_and_records_no_switch() -> None:
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR)
    events = len(ctrl.events)
    assert ctrl.price_prompts(0.9, 1) is Action.keep
    assert ctrl.state is Mode.on and len(ctrl.events) == events


def test_prompts_can_admit_what_a_low_prior_disabled() -> None:
    ctrl = LiveController(BANDWIDTH_BOUND, prior=AcceptancePrior(name="low", acceptance=0.02))
    assert ctrl.state is Mode.suspended
    assert ctrl.price_prompts(0.9, 1) is Action.resume
    assert ctrl.state is Mode.on and ctrl.events[-1].reason == LiveReason.prompt_acceptance


def test_compute_bound_stays_off_where_only_perfect_acceptance_would_pay() -> None:
    ctrl = LiveController(COMPUTE_BOUND, prior=PRIOR)
    assert ctrl.state is Mode.suspended
    # a 2-token verify costs 1.8, the head 0.1: 0.9 per draft yields 1.9 tokens per 1.9
    assert ctrl.price_prompts(0.9, 1) is Action.keep and ctrl.state is Mode.suspended


def test_after_the_first_step_the_live_counters_rule() -> None:
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR)
    ctrl.update(1, accepted=1, proposed=1, accepted_per_position=[1])
    sent = ctrl.mode.sent
    assert ctrl.price_prompts(0.0, 1) is Action.keep
    assert ctrl.state is Mode.on and ctrl.mode.sent == sent and ctrl.prompt_acceptance is None


@pytest.mark.parametrize("policy", ["force_on", "force_off"])
def test_a_pinned_policy_ignores_the_prompts(policy: str) -> None:
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR, policy=policy)
    state = ctrl.state
    assert ctrl.price_prompts(0.0, 1) is Action.keep and ctrl.state is state


def test_auto_depth_repicks_its_first_depth_at_the_prompts_acceptance() -> None:
    # a verify of k + 1 tokens costs 1 + 0.25 k: deep drafts pay only at high acceptance
    table = Timings(t_1=1.0, t_verify=1.5, t_head=0.05, k=2, batch_size=1)
    ctrl = LiveController(table, prior=PRIOR, depth="auto", max_depth=3)
    deep = ctrl.k
    assert deep >= 2
    ctrl.price_prompts(0.45, 1)
    assert ctrl.k < deep and ctrl.depth_reason is DepthReason.model
    assert ctrl.depth_decision.k == ctrl.k and ctrl.depth_decision.reason is DepthReason.model


def test_acceptance_outside_zero_one_is_refused() -> None:
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR)
    with pytest.raises(PolicyError):
        ctrl.price_prompts(1.5, 1)
    assert ctrl.state is Mode.on
