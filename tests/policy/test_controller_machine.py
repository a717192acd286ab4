"""The live controller is the machine spec/controller.toml says, walked by Hypothesis.

Rules of this file:
- A rule-based state machine feeds the controller synthetic timings from a world whose
  speeds, acceptance, noise and budget change between rules (tests/policy/world.py);
  after every update it checks that each mode change was one transition of the spec,
  and replays the same events, with the same guard values, into the python-statemachine
  oracle compiled from the same file: both compilations must land in the same mode.
- The behaviour the spec promises is checked beside it: the modes that draft are exactly
  the ones that speculate, final modes never change, a periodic switch waits out the
  minimum dwell, and a probe window ends within probe_max_steps.
- A sweep asserts that the suite's worlds reach every transition the spec declares, so a
  transition no code path can take fails here instead of rotting in the diagram.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from melix_fsm.machine import Step, build_oracle
from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.cost_model import AcceptancePrior
from melix_fsm.policy.depth import DEPTH, DepthMode
from melix_fsm.policy.errors import CalibrationError
from melix_fsm.policy.live_types import Action, LiveConfig
from melix_fsm.policy.modes import CONTROLLER, ON_SIDE, PROBES, SPECULATING, Mode, ModeEvent

from .conftest import BANDWIDTH_BOUND, COMPUTE_BOUND, PRIOR
from .world import World

# Short windows so a few hundred steps visit every mode.
CFG = LiveConfig(
    first_probe_after=8,
    first_spec_probe_after=8,
    doubtful_probe_after=16,
    plain_probe_every=16,
    probe_after=16,
    probe_max_after=64,
    min_dwell=4,
    probe_min_remaining=8,
)
TIMINGS = [BANDWIDTH_BOUND, COMPUTE_BOUND, None, CalibrationError("measurement_poisoned", "prefill beside")]
Oracle = build_oracle(CONTROLLER.spec)
DepthOracle = build_oracle(DEPTH.spec)


def guard_values(step: Step) -> dict[str, bool]:
    if step.guard is None:
        return {}
    return {step.guard.lstrip("!"): not step.guard.startswith("!")}


class ControllerWalk(RuleBasedStateMachine):
    @initialize(
        timings=st.sampled_from(TIMINGS),
        policy=st.sampled_from(["auto", "auto", "force_on", "force_off"]),
        depth=st.sampled_from([1, 2, "auto"]),
        rows=st.integers(1, 4),
        seed=st.integers(0, 2**16),
    )
    def start(self, timings: Any, policy: str, depth: Any, rows: int, seed: int) -> None:
        self.ctrl = LiveController(timings, prior=PRIOR, policy=policy, depth=depth, max_depth=3, config=CFG)
        self.world = World(batch_size=rows, seed=seed)
        self.oracle = Oracle()
        self.depth_oracle = DepthOracle()
        self.depth_seen = 0
        self.seen = 0
        self.last_side_switch = 0
        self.probe_steps = 0
        self.check_new_steps()

    def check_new_steps(self) -> None:
        """Each mode change since the last check is a spec transition the oracle agrees with."""
        mode = self.ctrl.mode
        new = mode.history[len(mode.history) - (mode.sent - self.seen) :] if mode.sent > self.seen else []
        assert len(new) == mode.sent - self.seen, "more events in one update than the history keeps"
        for step in new:
            assert self.oracle.current_state_value == step.source, (step, self.oracle.current_state_value)
            cell = CONTROLLER.table.get((Mode(step.source), ModeEvent(step.event)))
            assert cell is not None, f"{step} is not a transition of spec/controller.toml"
            self.oracle.send(step.event, **guard_values(step))
            assert self.oracle.current_state_value == step.target, (step, self.oracle.current_state_value)
            if step.event in (ModeEvent.suspend, ModeEvent.resume):
                assert self.ctrl.step - self.last_side_switch >= CFG.min_dwell, (step, self.ctrl.step)
            switched = (Mode(step.source) in ON_SIDE) != (Mode(step.target) in ON_SIDE)
            if switched and step.source != "configured":
                self.last_side_switch = self.ctrl.step
        self.seen = mode.sent
        assert self.oracle.current_state_value == self.ctrl.state
        self.check_depth()

    def check_depth(self) -> None:
        """The depth chooser's moves are spec/depth.toml's transitions, as the oracle takes them."""
        depth = self.ctrl.depth
        tracker = depth.mode
        new = tracker.sent - self.depth_seen
        for step in tracker.history[len(tracker.history) - new :] if new else []:
            assert self.depth_oracle.current_state_value == step.source, step
            self.depth_oracle.send(step.event)
            assert self.depth_oracle.current_state_value == step.target, step
        self.depth_seen = tracker.sent
        assert (tracker.state is DepthMode.exploring) == (depth.exploring is not None)
        if tracker.state is DepthMode.fixed:
            assert depth.k == depth.max_k and not depth.events
        if self.ctrl.state not in SPECULATING:
            assert depth.exploring is None, "no depth window while the controller decodes plainly"

    @rule(
        cycle=st.floats(0.4, 3.0),
        keep=st.floats(0.0, 1.0),
        noise=st.sampled_from([0.0, 0.05, 0.3]),
        budget=st.one_of(st.none(), st.integers(0, 400)),
    )
    def change_world(self, cycle: float, keep: float, noise: float, budget: int | None) -> None:
        self.world.cycle_s = lambda k, c=cycle: c * (1.0 + 0.05 * k)
        self.world.keep, self.world.noise, self.world.budget = keep, noise, budget

    @rule(n=st.integers(1, 60), timed=st.booleans(), exclude=st.booleans())
    def decode(self, n: int, timed: bool, exclude: bool) -> None:
        for _ in range(n):
            before_mode, before_spec = self.ctrl.state, self.ctrl.speculating
            action, drafted = self.world.step(self.ctrl, timed=timed, exclude=exclude)
            assert drafted == before_spec
            self.check_new_steps()
            after = self.ctrl.speculating
            expected = Action.keep if after == before_spec else (Action.resume if after else Action.suspend)
            assert action is expected
            if before_mode in CONTROLLER.finals:
                assert self.ctrl.state is before_mode, "a final mode changed"
            self.probe_steps = self.probe_steps + 1 if self.ctrl.state in PROBES else 0
            assert self.probe_steps <= CFG.probe_max_steps

    @rule(acceptance=st.floats(0.0, 1.0))
    def price_prompts(self, acceptance: float) -> None:
        """Rows' prompts priced at any time: it re-decides only before the first step."""
        before_mode, measured = self.ctrl.state, self.ctrl.step > 0
        action = self.ctrl.price_prompts(acceptance, self.world.batch_size)
        self.check_new_steps()
        if measured or before_mode not in (Mode.on, Mode.suspended):
            assert action is Action.keep and self.ctrl.state is before_mode
        else:  # the first decision taken again, on the cost model at the prompts' acceptance
            assert self.ctrl.mode.history[-1].event == ModeEvent.reprice
            predicted = self.ctrl._predicted(self.world.batch_size, self.ctrl.k)
            admits = predicted is not None and predicted >= 1.0 + CFG.margin
            assert self.ctrl.state is (Mode.on if admits else Mode.suspended)
            assert self.ctrl.summary()["prompt_acceptance"] == acceptance

    @invariant()
    def speculating_is_the_mode(self) -> None:
        if hasattr(self, "ctrl"):
            assert self.ctrl.speculating == (self.ctrl.state in SPECULATING)
            assert self.ctrl.disabled == (self.ctrl.state is Mode.disabled)


ControllerWalk.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestControllerWalk = ControllerWalk.TestCase


def _walk(
    timings: Any,
    policy: str,
    phases: list[tuple[float, float, float]],
    seed: int,
    prior: AcceptancePrior = PRIOR,
    prompts: float | None = None,
) -> set[tuple[str, str]]:
    ctrl = LiveController(timings, prior=prior, policy=policy, depth=1, config=CFG)
    if prompts is not None:
        ctrl.price_prompts(prompts, 1)
    world = World(seed=seed, noise=0.05)
    for cycle, keep, plain in phases:
        world.cycle_s, world.keep, world.plain_s = (lambda k, c=cycle: c), keep, plain
        for _ in range(120):
            world.step(ctrl)
    return {(s.source, s.event) for s in ctrl.mode.history}


def test_the_worlds_reach_every_transition_of_the_spec() -> None:
    fast, slow, tie = (0.9, 0.9, 1.0), (3.0, 0.1, 1.0), (1.8, 0.8, 1.0)
    plain_slows = (3.0, 0.1, 10.0)  # measured while suspended: the periodic comparison resumes
    covered: set[tuple[str, str]] = set()
    for timings in TIMINGS:
        for policy in ("auto", "force_on", "force_off"):
            for seed in range(3):
                for phases in ([fast, slow, fast, slow], [slow, fast, tie, slow, fast], [slow, plain_slows]):
                    covered |= _walk(timings, policy, phases, seed)
    low_prior = AcceptancePrior(name="low", acceptance=0.05)
    for prior in (PRIOR, low_prior):  # the prior admits, or not; the prompts then do, or not
        for prompts in (0.0, 0.95):
            covered |= _walk(BANDWIDTH_BOUND, "auto", [fast, slow], 0, prior, prompts)
    declared = {(t.source, t.event) for t in CONTROLLER.spec.transitions}
    assert declared - covered == set(), f"transitions no world reached: {sorted(declared - covered)}"


@pytest.mark.parametrize("event", list(ModeEvent))
def test_an_event_the_table_lacks_is_refused_and_changes_nothing(event: ModeEvent) -> None:
    ctrl = LiveController(None, policy="force_off")
    assert ctrl.state is Mode.force_off
    with pytest.raises(Exception) as info:
        ctrl.mode.send(event)
    assert type(info.value).__name__ == "IllegalTransition"
    assert ctrl.state is Mode.force_off and not ctrl.speculating
