"""The cycle engine's queue of launched steps is spec/pipeline.toml's machine.

Rules of this file:
- Both decoders drive one engine; every launch, settle, undo, fault and reshape is an
  event of the spec, and the queue's length is the state's (`IN_FLIGHT`). Here the
  single-sequence decoder runs ahead (the GPU default) and behind, runs to its end and is
  closed early, and each time the engine's history replays into the python-statemachine
  oracle compiled from the same file and ends idle with nothing left in flight.
- What the table refuses, the engine refuses before any work: a third launch while two
  steps are in flight raises IllegalTransition and leaves the queue as it was.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.decode import MTPDecoder
from melix_mlx.runtime.engine_records import RowPlan

from melix_fsm.errors import IllegalTransition
from melix_fsm.machine import build_oracle
from melix_fsm.pipeline import IN_FLIGHT, PIPELINE, PipelineState

PROMPT = [104, 101, 97, 100, 33]
Oracle = build_oracle(PIPELINE.spec)


def replay(engine) -> set[tuple[str, str]]:
    """Replay the engine's pipeline history into the oracle; the transitions taken."""
    tracker = engine.pipeline
    assert tracker.sent == len(tracker.history), "a short run keeps its whole history"
    oracle = Oracle()
    for step in tracker.history:
        guards = {} if step.guard is None else {step.guard.lstrip("!"): not step.guard.startswith("!")}
        assert oracle.current_state_value == step.source, step
        oracle.send(step.event, **guards)
        assert oracle.current_state_value == step.target, step
    assert oracle.current_state_value == tracker.state
    assert len(engine.in_flight) == IN_FLIGHT[tracker.state]
    return {(s.source, s.event) for s in tracker.history}


@pytest.mark.parametrize("run_ahead", [True, False])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_a_run_is_a_walk_of_the_pipeline(loaded_heads, family: str, run_ahead: bool) -> None:
    model, _, head, _ = loaded_heads[family]
    got, decoder = mtp(model, head, PROMPT, 24, 2, run_ahead=run_ahead)
    assert got == reference(model, PROMPT, 24)
    taken = replay(decoder.engine)
    assert decoder.engine.pipeline.state is PipelineState.idle
    assert ("idle", "launch") in taken and ("in_flight", "settle") in taken
    if run_ahead:  # plain steps always pipeline; with run_ahead cycles do too
        assert ("in_flight", "launch") in taken and ("ahead", "settle") in taken


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_closing_early_undoes_what_is_in_flight(loaded_heads, family: str) -> None:
    model, _, head, _ = loaded_heads[family]
    decoder = MTPDecoder(model, head, num_draft_tokens=2, run_ahead=True)
    stream = decoder.generate(mx.array(PROMPT), 50)
    for _ in range(7):
        next(stream)
    assert decoder.engine.pipeline.state is not PipelineState.idle  # the next step runs meanwhile
    stream.close()
    assert decoder.engine.pipeline.state is PipelineState.idle and not decoder.engine.in_flight
    assert ("in_flight", "abandon") in replay(decoder.engine) or ("ahead", "abandon") in replay(
        decoder.engine
    )


def test_a_third_launch_is_refused_before_any_work(loaded_heads) -> None:
    model, _, head, _ = loaded_heads["deepseek_v3"]
    decoder = MTPDecoder(model, head, num_draft_tokens=1, run_ahead=True)
    stream = decoder.generate(mx.array(PROMPT), 50)
    next(stream)
    engine = decoder.engine
    while engine.pipeline.state is not PipelineState.ahead:
        engine.plain([RowPlan(k=0, params=None, sampler=None)])
    before = list(engine.in_flight)
    forwards = engine.target_forwards
    with pytest.raises(IllegalTransition):
        engine.plain([RowPlan(k=0, params=None, sampler=None)])
    with pytest.raises(IllegalTransition):
        engine.launch([RowPlan(k=1, params=None, sampler=None)])
    assert engine.in_flight == before and engine.target_forwards == forwards
    engine.abandon(before[0])  # the oldest: the step built on it is void too
    assert engine.pipeline.state is PipelineState.idle and not engine.in_flight
    assert engine.pipeline.history[-1].guard == "!newest"
    stream.close()
