"""Auto depth: k from measured tokens/s per depth; never a k slower than a smaller one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.cost_model import AcceptancePrior, Timings
from melix_fsm.policy.depth import DepthChooser, DepthConfig, DepthReason, model_choice
from melix_fsm.policy.errors import PolicyError
from melix_fsm.policy.throughput import PositionAcceptance

from .conftest import BANDWIDTH_BOUND, COMPUTE_BOUND, PRIOR
from .world import World, run


def settled_k_is_not_slower_than_a_smaller_one(ctrl: LiveController) -> None:
    """The invariant, read off the controller's own measurements after a step."""
    if ctrl.depth.exploring is not None or ctrl.state.endswith("probe"):
        return  # a window decides when it ends
    rates = ctrl.depth.measured_rates()
    chosen = ctrl.depth.chosen
    if not rates:
        return
    if chosen not in rates:  # stepped down after losing to plain: it awaits its own window
        lost = (e for e in ctrl.depth_events if e.reason is DepthReason.lost_to_plain)
        assert any(e.k_after == chosen for e in lost), "a measured depth exists: the chosen one is measured"
        return
    for j, rate in rates.items():
        if j < chosen:
            assert rate < rates[chosen], (j, rate, chosen, rates[chosen])


@settings(max_examples=40, deadline=None)
@given(
    cycles=st.lists(st.floats(0.8, 3.0), min_size=3, max_size=3),
    keep=st.floats(0.0, 1.0),
    noise=st.floats(0.0, 0.3),
    rows=st.integers(1, 4),
    policy=st.sampled_from(["auto", "force_on"]),
    seed=st.integers(0, 2**16),
)
def test_never_settles_on_a_k_measured_slower_than_a_smaller_k(cycles, keep, noise, rows, policy, seed):
    world = World(keep=keep, noise=noise, batch_size=rows, seed=seed, cycle_s=lambda k: cycles[k - 1])
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR, policy=policy, depth="auto", max_depth=3)
    for _ in range(800):
        world.step(ctrl)
        assert 1 <= ctrl.k <= 3
        settled_k_is_not_slower_than_a_smaller_one(ctrl)


def test_a_deeper_k_that_measures_slower_is_left():
    # the prior (acceptance 0.8, bandwidth-bound) starts deep; k = 1 truly wins here
    world = World(keep=0.6, cycle_s=lambda k: 1.0 + 0.5 * k, seed=3)
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR, depth="auto", max_depth=3)
    assert ctrl.depth_decision.k >= 2 and ctrl.depth_decision.reason is DepthReason.prior
    history = []
    for _ in range(3000):
        k = ctrl.k if ctrl.speculating else 0
        world.step(ctrl)
        history.append(k)
    assert ctrl.depth.chosen == 1
    late = [k for k in history[1000:] if k]
    assert late.count(1) / len(late) > 0.9  # explorations upward back off


def test_a_depth_that_loses_to_plain_is_not_the_only_one_probed():
    """Suspended at k = 2 (it loses to plain) while k = 1 pays: explorations run only while
    speculating, so each failed probe must step the depth down, or k = 2 would be probed
    for ever. Here k = 2 runs at 0.83x plain and k = 1 at 1.2x."""
    world = World(keep=0.5, cycle_s=lambda k: 1.25 if k == 1 else 2.1, noise=0.03, seed=5)
    assert world.true_speedup(1) == pytest.approx(1.2) and world.true_speedup(2) < 0.85
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR, depth="auto", max_depth=2, active=False)
    assert ctrl.depth.chosen == 2 and not ctrl.speculating
    history = []
    for _ in range(1500):
        k = ctrl.k if ctrl.speculating else 0
        world.step(ctrl)
        history.append(k)
        settled_k_is_not_slower_than_a_smaller_one(ctrl)
    stepped = [e for e in ctrl.depth_events if e.reason is DepthReason.lost_to_plain]
    assert stepped and stepped[0].k_before == 2 and stepped[0].k_after == 1
    assert ctrl.depth.chosen == 1 and ctrl.counters.probes_passed >= 1
    late = history[-500:]
    assert late.count(1) / len(late) > 0.9  # on at k = 1 (plain probes and upward looks aside)


def test_a_deeper_k_that_measures_faster_is_adopted():
    world = World(keep=0.9, cycle_s=lambda k: 1.0 + 0.05 * k, seed=4)  # k=3 ~1.5x k=1
    ctrl = LiveController(COMPUTE_BOUND, prior=PRIOR, policy="force_on", depth="auto", max_depth=3)
    assert ctrl.depth_decision.k == 1  # compute-bound prior: the smallest depth
    run(world, ctrl, 1500)
    assert ctrl.depth.chosen == 3 and ctrl.depth.changes >= 2
    assert ctrl.summary()["k_chosen"] == 3


def test_a_tie_within_noise_goes_to_the_smaller_k():
    # k=1 and k=2 run at the same tokens/s (+-10% per step): the smaller k must win
    keep = 0.7
    world = World(keep=keep, noise=0.1, seed=5)
    e1, e2 = 1 + keep, 1 + keep + keep**2
    world.cycle_s = lambda k: e1 if k == 1 else e2
    ctrl = LiveController(None, prior=PRIOR, policy="force_on", depth="auto", max_depth=2)
    chosen = []
    for _ in range(3000):
        world.step(ctrl)
        chosen.append(ctrl.depth.chosen)
    assert chosen[500:].count(1) / len(chosen[500:]) > 0.9 and chosen[-1] == 1


def test_fixed_depth_never_moves():
    ctrl = LiveController(BANDWIDTH_BOUND, prior=PRIOR, policy="force_on", depth=2)
    run(World(keep=0.1, cycle_s=lambda k: 1.0 + k), ctrl, 500)
    assert ctrl.k == 2 and ctrl.depth.explorations == 0 and ctrl.depth_decision.mode == "fixed"


def test_prior_depth_is_the_cost_models_best_ties_to_smaller():
    acceptance = PositionAcceptance(4, 0.95, prior=0.8)
    free = lambda k: 1.0  # noqa: E731  every depth costs the same: deepest wins
    assert model_choice(acceptance, free, 4, 0.03) == 4
    linear = lambda k: 1.0 + k  # noqa: E731  each draft costs a full step: k=1 wins
    assert model_choice(acceptance, linear, 4, 0.03) == 1
    # equal within the tie: the smaller
    flat = PositionAcceptance(2, 0.95, prior=0.0)
    assert model_choice(flat, free, 2, 0.03) == 1


def test_receipt_records_the_first_depth_and_candidates():
    ctrl = LiveController(BANDWIDTH_BOUND, prior=AcceptancePrior(name="x", acceptance=0.7), depth="auto")
    d = ctrl.depth_decision
    assert d.mode == "auto" and d.max_k == 4 and set(d.predicted_speedup) == {"1", "2", "3", "4"}
    best = max(d.predicted_speedup.values())
    assert d.predicted_speedup[str(d.k)] >= best * (1 - 0.03)


def test_acceptance_per_position_is_measured_and_continued():
    acc = PositionAcceptance(3, 1.0, prior=0.5)
    assert acc.positions(3) == pytest.approx([0.5, 0.25, 0.125])  # geometric prior
    acc.observe([8, 4], rows=10)  # k = 2 cycles of 10 rows
    assert acc.positions(3) == pytest.approx([0.8, 0.4, 0.2])  # position 3 continued
    assert acc.expected_tokens(2) == pytest.approx(2.2)


def test_untimed_depth_follows_the_cost_model_with_live_acceptance():
    t = Timings(t_1=1.0, t_verify=1.0, t_head=0.05, k=3)
    ctrl = LiveController(t, prior=PRIOR, policy="force_on", depth="auto", max_depth=3)
    start = ctrl.k
    for _ in range(400):  # nothing accepted: deeper drafts cannot pay
        ctrl.update(1, 0, ctrl.k, accepted_per_position=[0] * ctrl.k)
    assert start > 1 and ctrl.k == 1
    assert any(e.reason is DepthReason.model for e in ctrl.depth_events)


def test_depth_config_is_checked():
    with pytest.raises(PolicyError):
        DepthConfig(explore_steps=0)
    with pytest.raises(PolicyError):
        DepthChooser(max_k=2, initial_k=3, auto=True, acceptance=PositionAcceptance(2, 1.0, 0.5), decay=0.9)
