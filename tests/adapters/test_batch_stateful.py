"""Identity under reshaping: random insert / next / remove / suspend-resume schedules on the
real tiny checkpoints.

Every request's tokens must equal mlx-lm's own single-sequence greedy decoding of it
(cut at its max_tokens or at its stop sequence); a removed request's tokens must be a
prefix of that. After every step the batch invariants of spec/batch.toml are checked on
the generator's own lifecycle batch, and the batch rows must line up with the cache rows.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads
from melix_mlx.tools.tiny import make_tiny
from mlx_lm.generate import StopSequences, generate_step

from melix_fsm import invariants
from melix_fsm.machine import build_oracle
from melix_fsm.pipeline import IN_FLIGHT, PIPELINE

_ROOT = Path(tempfile.mkdtemp(prefix="melix-batch-stateful-"))


@functools.cache
def _loaded(family: str) -> tuple:
    path = make_tiny(family, _ROOT / family, seed=3)
    model, _, head, _ = load_with_heads(path)
    return model, head


@functools.cache
def _reference(family: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    model, _ = _loaded(family)
    return tuple(t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens))


def _cut_at_stop(tokens: tuple[int, ...], stop: tuple[int, ...] | None) -> tuple[int, ...]:
    """mlx-lm semantics: generation ends on the token that completes the stop sequence."""
    if not stop:
        return tokens
    for end in range(len(tokens)):
        if end + 1 >= len(stop) and tokens[end + 1 - len(stop) : end + 1] == stop:
            return tokens[: end + 1]
    return tokens


def _cache_rows(cache: list) -> set[int]:
    rows = set()
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, mx.array):
            rows.add(offset.shape[0])
        elif hasattr(c, "batch_size"):
            rows.add(c.batch_size)
    return rows


prompts = st.lists(st.integers(3, 255), min_size=1, max_size=10).map(tuple)


class FlippingController:
    """A verdict the state machine flips; the flip takes effect at the generator's next
    update, as a live controller's switches do. Records any step begun under a plain
    verdict that drafted."""

    def __init__(self) -> None:
        self.speculating = True
        self.k = 3
        self.events: list = []
        self.disabled = False
        self.flip_due = False
        self.violations: list[str] = []

    def update(self, batch_size, accepted=0, proposed=0, **timing) -> None:
        if not self.speculating and proposed:
            self.violations.append(f"{proposed} drafts under a plain verdict")
        if self.flip_due:
            self.speculating, self.flip_due = not self.speculating, False

    def summary(self) -> dict:
        return {"speculating": self.speculating}


PipelineOracle = build_oracle(PIPELINE.spec)


def check_pipeline(engine, owner) -> None:
    """Replay the engine pipeline's new steps into the oracle (kept on `owner`)."""
    tracker = engine.pipeline
    assert len(engine.in_flight) == IN_FLIGHT[tracker.state], (engine.in_flight, tracker.state)
    oracle = getattr(owner, "_pipeline_oracle", None) or PipelineOracle()
    seen = getattr(owner, "_pipeline_seen", 0)
    new = tracker.sent - seen
    assert new <= len(tracker.history)
    for step in tracker.history[len(tracker.history) - new :]:
        guards = {} if step.guard is None else {step.guard.lstrip("!"): not step.guard.startswith("!")}
        assert oracle.current_state_value == step.source, step
        oracle.send(step.event, **guards)
        assert oracle.current_state_value == step.target, step
    owner._pipeline_oracle, owner._pipeline_seen = oracle, tracker.sent


def make_machine(family: str) -> type[RuleBasedStateMachine]:
    class BatchIdentity(RuleBasedStateMachine):
        requests = Bundle("requests")

        def __init__(self) -> None:
            super().__init__()
            model, head = _loaded(family)
            self.controller = FlippingController()
            self.gen = MTPBatchGenerator(
                model, head, num_draft_tokens=2, prefill_batch_size=2, controller=self.controller
            )
            self.expected: dict[int, tuple[int, ...]] = {}
            self.got: dict[int, list[int]] = {}
            self.finished: set[int] = set()
            self.removed: set[int] = set()

        @initialize(run_ahead=st.booleans())
        def pipeline(self, run_ahead: bool) -> None:
            """Both step orders: step n + 1 built before step n syncs (the GPU default) or not."""
            self.gen.run_ahead = run_ahead

        @rule(
            target=requests,
            prompt=prompts,
            max_tokens=st.integers(1, 10),
            k=st.integers(1, 3),
            stop_at=st.none() | st.tuples(st.integers(0, 9), st.integers(1, 2)),
        )
        def insert(self, prompt, max_tokens, k, stop_at):
            full = _reference(family, prompt, max_tokens)
            stop = None
            if stop_at is not None and stop_at[0] < len(full):
                stop = full[stop_at[0] : stop_at[0] + stop_at[1]]
            (uid,) = self.gen.insert(
                [list(prompt)],
                max_tokens=[max_tokens],
                stop_sequences=[StopSequences([stop] if stop else None)],
                num_draft_tokens=[k],
            )
            self.expected[uid] = _cut_at_stop(full, stop)
            self.got[uid] = []
            return uid

        @rule()
        def step(self):
            _, responses = self.gen.next()
            for r in responses:
                assert r.uid not in self.finished, f"uid {r.uid} produced a token after finishing"
                assert r.uid not in self.removed, f"uid {r.uid} produced a token after removal"
                self.got[r.uid].append(r.token)
                if r.finish_reason is not None:
                    self.finished.add(r.uid)
                    assert tuple(self.got[r.uid]) == self.expected[r.uid]
                    assert r.stats is not None and r.all_tokens is not None

        @rule()
        def flip(self):
            """Suspend or resume speculation at the next step's update (a plain step may be
            running ahead then: it is kept, its rows resume after it)."""
            self.controller.flip_due = True

        @precondition(lambda self: bool(self.got))
        @rule(uid=requests)
        def remove(self, uid):
            self.gen.remove([uid])
            if uid not in self.finished:
                self.removed.add(uid)
            assert uid not in self.gen.batch.uids

        @invariant()
        def tokens_are_reference_prefixes(self):
            for uid, tokens in self.got.items():
                expected = self.expected[uid]
                assert tuple(tokens) == expected[: len(tokens)], (uid, tokens, expected)

        @invariant()
        def no_drafts_under_a_plain_verdict(self):
            assert self.controller.violations == []

        @invariant()
        def pipeline_is_the_spec_machine(self):
            """The engine's queue of launched steps is as long as spec/pipeline.toml's state
            says, and every change of it was a transition the oracle takes too."""
            check_pipeline(self.gen.engine, self)

        @invariant()
        def batch_invariants_hold(self):
            invariants.check_batch(self.gen.batch)
            rows = _cache_rows(self.gen.cache)
            assert rows <= {len(self.gen.batch)}, (rows, len(self.gen.batch))

        def teardown(self):
            for _ in range(200):
                if not (self.gen.batch.uids or self.gen._queue):
                    break
                self.step()
            for uid, expected in self.expected.items():
                if uid not in self.removed:
                    assert tuple(self.got[uid]) == expected, (uid, self.got[uid], expected)

    BatchIdentity.__name__ = f"BatchIdentity_{family}"
    return BatchIdentity


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3", "qwen3_5"])
def test_batch_identity_under_reshaping(family: str) -> None:
    run_state_machine_as_test(
        make_machine(family),
        settings=settings(
            max_examples=settings().max_examples // 6 or 1,
            stateful_step_count=min(settings().stateful_step_count, 25),
        ),
    )
