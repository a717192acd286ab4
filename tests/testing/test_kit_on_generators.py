"""The conformance kit against real and deliberately broken batched MTP generators.

Rules of this file:
- The real MTPBatchGenerator must pass the kit on tiny checkpoints, with its random head
  (drafts almost always rejected) and with a scripted head (full and partial accepts,
  rollbacks), on a KV-only family and on the recurrent qwen3_5 (replayed rollbacks).
- Each broken generator (broken_generators.py) must fail with a ConformanceError whose
  property is the one that bug violates, whose message names it, and whose recorded
  schedule is short (shrunk) and replays to the same property without Hypothesis.
- Budget: small example counts and narrow draws (few distinct prompts, so the reference
  decoder runs rarely while Hypothesis shrinks); the whole file stays well under a minute.
  Runs use no example database, so each one finds its counter-example afresh.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from melix_mlx.batch_generator import MTPBatchGenerator  # noqa: E402

from melix_fsm.testing import (  # noqa: E402
    PROFILES,
    ConformanceError,
    mlx_greedy_reference,
    replay,
    run_conformance,
)

from .broken_generators import BROKEN  # noqa: E402

NARROW: dict[str, Any] = {"tokens": (3, 24), "prompt_lengths": (1, 5), "max_tokens": (1, 8)}
OPTIONS = {"num_draft_tokens": st.integers(1, 3)}


def budget(examples: int, steps: int = 15) -> settings:
    return settings(PROFILES["quick"], max_examples=examples, stateful_step_count=steps, database=None)


def factory(cls: type, head: Any) -> Callable[[Any], Any]:
    # small batches, so queueing (completion_batch_size) and staggered joins happen often
    return lambda model: cls(model, head, num_draft_tokens=2, prefill_batch_size=2, completion_batch_size=3)


@pytest.mark.parametrize("family", ["mimo", "qwen3_5"])
def test_real_generator_passes(tiny: Callable, family: str) -> None:
    model, head = tiny(family)
    run_conformance(
        factory(MTPBatchGenerator, head),
        models={family: model},
        insert_options=OPTIONS,
        settings=budget(12),
    )


@pytest.mark.parametrize("family", ["mimo", "qwen3_5"])
def test_real_generator_passes_while_plain(tiny: Callable, family: str) -> None:
    # plain rows run a step ahead, also while requests queue for a row (mlx-lm's pipelining)
    from melix_fsm.policy.controller import LiveController
    from melix_fsm.policy.decision import Policy

    model, head = tiny(family)
    run_conformance(
        lambda m: MTPBatchGenerator(
            m,
            head,
            prefill_batch_size=2,
            completion_batch_size=3,
            controller=LiveController(None, policy=Policy.force_off),
        ),
        models={family: model},
        insert_options=OPTIONS,
        settings=budget(12),
    )


@pytest.mark.parametrize("family", ["mimo", "qwen3_5"])
def test_real_generator_passes_with_accepting_head(scripted: Callable, family: str) -> None:
    model, head, reference = scripted(family, wrong_every=3)
    make = factory(MTPBatchGenerator, head)
    run_conformance(lambda: make(model), reference, insert_options=OPTIONS, settings=budget(12))
    assert head.calls > 0


# bug -> (the properties that may report it, whether it needs accepted drafts to show)
CAUGHT: dict[str, tuple[set[str], bool]] = {
    # a survivor re-admitted with fresh counters, or (when its machine was fresh anyway) the
    # cycle raising on the dropped head state (a fault inside a head forward, else an error)
    "drops_state_on_filter": (
        {"counters_agree", "generator_batch", "generator_raised", "no_silent_faults"},
        False,
    ),
    # the next cycle finds no draft: outside the forwards that is no speculative fault but
    # an error the engine surfaces (before it was swallowed as one)
    "drops_head_pairs_on_filter": ({"generator_raised", "no_silent_faults"}, False),
    "rolls_back_wrong_row": ({"tokens_match_reference"}, True),
    "emits_drafts_before_verify": ({"emitted_matches_events"}, False),
    "reorders_on_extend": ({"row_order"}, False),
}


@pytest.mark.parametrize("bug", sorted(CAUGHT))
def test_broken_generator_is_caught(tiny: Callable, scripted: Callable, bug: str) -> None:
    expected, needs_acceptance = CAUGHT[bug]
    if needs_acceptance:
        model, head, reference = scripted("mimo", wrong_every=3)
    else:
        model, head = tiny("mimo")
        reference = mlx_greedy_reference(model, min_tokens=NARROW["max_tokens"][1])
    make = factory(BROKEN[bug], head)
    with pytest.raises(ConformanceError) as info:
        run_conformance(lambda: make(model), reference, insert_options=OPTIONS, settings=budget(30), **NARROW)
    err = info.value
    text = str(err)
    assert err.prop in expected, text
    assert f"conformance property {err.prop!r} violated" in text
    assert "seed" in text and "schedule" in text
    # shrunk: a handful of operations, printed as JSON lines a user can paste back
    assert 1 <= len(err.schedule) <= 8, text
    for op in err.schedule:
        assert json.dumps(op) in text
    # and replayable without Hypothesis, on a fresh generator, to the same property
    with pytest.raises(ConformanceError) as again:
        replay(json.loads(json.dumps(err.schedule)), lambda: make(model), reference)
    assert again.value.prop == err.prop


def test_upstream_batch_generator_passes_token_checks(tiny: Callable) -> None:
    # mlx-lm's own BatchGenerator reports no events: the kit still checks its tokens
    from mlx_lm.generate import BatchGenerator

    model, _ = tiny("mimo")
    run_conformance(
        lambda m: BatchGenerator(m, prefill_batch_size=2, completion_batch_size=3),
        models={"mimo": model},
        check_events=False,
        settings=budget(12),
    )
