"""Behaviour agrees with the policy's verdict: no draft in a window it calls plain.

- A controller that follows a Hypothesis-drawn schedule of verdicts (speculate or not,
  and a depth) checks, at every step it is fed, that a step begun under a "plain"
  verdict proposed no draft, and that a speculative step drafted at most the depth it
  asked for. Tokens stay mlx-lm's. Single-sequence and batched, KV and hybrid caches.
- A failed calibration gives a disabled controller: zero drafts and zero head forwards
  (the head is not even primed), and the tokens are mlx-lm's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.decode import MTPDecoder
from mlx_lm.generate import generate_step

from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.decision import Policy
from melix_fsm.policy.errors import CalibrationError

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8]]
N = 16


class ScheduledController:
    """Verdicts from a schedule; asserts each step obeyed the verdict it began under."""

    def __init__(self, schedule: list[tuple[bool, int]]) -> None:
        self.schedule = schedule
        self.step = 0
        self.events: list = []
        self.violations: list[str] = []
        self.steps_plain = 0

    @property
    def speculating(self) -> bool:
        return self.schedule[self.step % len(self.schedule)][0]

    @property
    def k(self) -> int:
        return self.schedule[self.step % len(self.schedule)][1]

    @property
    def disabled(self) -> bool:
        return False

    def update(self, batch_size, accepted=0, proposed=0, *, accepted_per_position=None, **timing):
        if not self.speculating and proposed:
            self.violations.append(f"step {self.step}: {proposed} drafts under a plain verdict")
        if self.speculating and proposed > self.k * batch_size:
            self.violations.append(f"step {self.step}: {proposed} drafts, depth {self.k}")
        self.steps_plain += not self.speculating
        self.step += 1

    def summary(self) -> dict:
        return {"steps": self.step}


class AnnouncingController(ScheduledController):
    """Also says, a step ahead, when its next update turns speculation off
    (LiveController.plain_due)."""

    @property
    def plain_due(self) -> bool:
        n = len(self.schedule)
        return self.schedule[self.step % n][0] and not self.schedule[(self.step + 1) % n][0]


def _reference(model, prompt: list[int]) -> list[int]:
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=N)]


def _decode_batch(gen: MTPBatchGenerator) -> list[list[int]]:
    """Each of PROMPTS' tokens from the generator, in prompt order."""
    uids = gen.insert(PROMPTS)
    got: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
    return [got[u] for u in uids]


SCHEDULES = st.lists(st.tuples(st.booleans(), st.integers(1, 3)), min_size=1, max_size=6)


@pytest.mark.parametrize("family", ["mimo", "qwen3_5"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=SCHEDULES, run_ahead=st.booleans())
def test_single_sequence_drafts_only_when_told(loaded_heads, family: str, schedule, run_ahead) -> None:
    model, _, head, _ = loaded_heads[family]
    controller = ScheduledController(schedule)
    decoder = MTPDecoder(model, head, num_draft_tokens=3, controller=controller, run_ahead=run_ahead)
    tokens = [t for t, _, _ in decoder.generate(mx.array(PROMPTS[0]), N)]
    assert controller.violations == []
    assert tokens == _reference(model, PROMPTS[0])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=SCHEDULES, run_ahead=st.booleans())
def test_batch_drafts_only_when_told(loaded_heads, schedule, run_ahead) -> None:
    model, _, head, _ = loaded_heads["mimo"]
    controller = ScheduledController(schedule)
    gen = MTPBatchGenerator(
        model, head, num_draft_tokens=3, max_tokens=N, controller=controller, run_ahead=run_ahead
    )
    assert _decode_batch(gen) == [_reference(model, p) for p in PROMPTS]
    assert controller.violations == []


# speculating three steps, then plain: with cycles built ahead (run_ahead), the switch
# undoes the one built ahead of it unless the controller announced it
SWITCHING = [(True, 2)] * 3 + [(False, 2)] * (4 * N)


def test_an_announced_switch_to_plain_undoes_no_cycle_built_ahead(loaded_heads) -> None:
    model, _, head, _ = loaded_heads["qwen3_5"]
    for announcing in (False, True):
        controller = (AnnouncingController if announcing else ScheduledController)(SWITCHING)
        decoder = MTPDecoder(model, head, num_draft_tokens=2, controller=controller, run_ahead=True)
        tokens = [t for t, _, _ in decoder.generate(mx.array(PROMPTS[0]), N)]
        assert tokens == _reference(model, PROMPTS[0]) and controller.violations == []
        assert decoder.stats["abandoned_steps"] == (0 if announcing else 1)
        controller = (AnnouncingController if announcing else ScheduledController)(SWITCHING)
        gen = MTPBatchGenerator(
            model, head, num_draft_tokens=2, max_tokens=N, controller=controller, run_ahead=True
        )
        assert _decode_batch(gen) == [_reference(model, p) for p in PROMPTS]
        assert controller.violations == []
        assert gen.speculative_stats()["abandoned_steps"] == (0 if announcing else 1)


# plain three steps, then speculating: the plain step running ahead when the verdict
# resumes is kept (the row resumes after it), so nothing is undone
RESUMING = [(False, 2)] * 3 + [(True, 2)] * (4 * N)


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_resume_keeps_the_plain_step_running_ahead(loaded_heads, run_ahead: bool) -> None:
    model, _, head, _ = loaded_heads["qwen3_5"]
    controller = ScheduledController(RESUMING)
    decoder = MTPDecoder(model, head, num_draft_tokens=2, controller=controller, run_ahead=run_ahead)
    tokens = [t for t, _, _ in decoder.generate(mx.array(PROMPTS[0]), N)]
    stats = decoder.stats
    assert tokens == _reference(model, PROMPTS[0]) and controller.violations == []
    assert stats["abandoned_steps"] == 0 and stats["plain_steps"] == 3 + 1
    assert stats["resumptions"] == 1 and stats["proposed"] > 0
    controller = ScheduledController(RESUMING)
    gen = MTPBatchGenerator(
        model, head, num_draft_tokens=2, max_tokens=N, controller=controller, run_ahead=run_ahead
    )
    assert _decode_batch(gen) == [_reference(model, p) for p in PROMPTS]
    totals = gen.speculative_stats()
    assert controller.violations == [] and totals["abandoned_steps"] == 0
    assert totals["resumptions"] == 2 and totals["proposed"] > 0


def test_scheduled_controller_catches_a_decoder_that_ignores_it(loaded_heads) -> None:
    """The check is sharp: a decoder that drafts regardless of the verdict is caught."""
    model, _, head, _ = loaded_heads["mimo"]
    controller = ScheduledController([(True, 2), (False, 2)])

    class Deaf(MTPDecoder):
        """Reads the controller once at admission, then speculates whatever it says."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.steps.reconcile = lambda *_: None  # the verdict never becomes lifecycle events

        def _depth(self, remaining: int) -> int:
            return max(1, min(self.k, remaining - 1))

    decoder = Deaf(model, head, num_draft_tokens=2, controller=controller)
    for _ in decoder.generate(mx.array(PROMPTS[0]), N):
        pass
    assert controller.violations


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_failed_calibration_never_drafts(loaded_heads, family: str) -> None:
    model, _, head, _ = loaded_heads[family]
    failed = CalibrationError("measurement_timeout", "two CPU hogs")
    controller = LiveController(failed, policy=Policy.auto)
    assert controller.disabled and not controller.speculating
    decoder = MTPDecoder(model, head, num_draft_tokens=2, controller=controller)
    long = 3 * N  # past the engine's pending-pair flush: still no head work
    tokens = [t for t, _, _ in decoder.generate(mx.array(PROMPTS[0]), long)]
    stats = decoder.stats
    assert tokens == [t for t, _ in generate_step(mx.array(PROMPTS[0]), model, max_tokens=long)]
    assert stats["proposed"] == 0 and stats["head_forwards"] == 0
    assert stats["state"] == "suspended"
    gen = MTPBatchGenerator(
        model, head, num_draft_tokens=2, max_tokens=N, controller=LiveController(failed, policy=Policy.auto)
    )
    gen.insert(PROMPTS)
    while gen.next_generated():
        pass
    totals = gen.speculative_stats()
    assert totals["proposed"] == 0 and totals["head_forwards"] == 0
