"""A short prompt joins without waiting for a segment of a long one, and the long one goes on.

The serving generator's step runs the rows' decode, the segment stage (a time-budgeted
piece of each long prompt) and the admission of prompts ready to join; a step's tokens
reach the clients when the whole step returns. A step in which a short prompt joins skips
the segment stage, so its first token waits for no segment; the next step's segment stage
runs whatever waits (a stream of arrivals cannot stall the long prompt). Driven directly
on the generator, with the embedded checkpoint.
"""

from __future__ import annotations

from typing import Any

import pytest
from melix_mlx.loading.checkpoints import EMBEDDED
from melix_mlx.serve.prompt_work import PROBE

CKPT = EMBEDDED["stdlib-tiny"]
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


def generator(budget_s: float) -> tuple[Any, Any]:
    from melix_mlx.loading import load_with_heads
    from melix_mlx.serve.metrics import ServeMetrics
    from melix_mlx.serve.runtime import ServingBatchGenerator

    model, tokenizer, head, _ = load_with_heads(CKPT)
    gen = ServingBatchGenerator(
        model, head, contexts={}, pending=[], metrics=ServeMetrics(), prefill_budget_s=budget_s
    )
    return gen, tokenizer


def test_a_joining_step_runs_no_segment_and_the_next_step_runs_one() -> None:
    gen, tokenizer = generator(budget_s=5.0)
    long_prompt = tokenizer.encode(" ".join(["The old king walked the long road home."] * 40))
    (long_uid,) = gen.insert_segments([[long_prompt]], max_tokens=[1])
    for _ in range(2):  # the long prompt's first pieces (its probe, then a measured piece)
        responses, _ = gen.next()
        assert [r.uid for r in responses] == [long_uid]
    (short_uid,) = gen.insert_segments([[tokenizer.encode("Once upon")]], max_tokens=[3])
    responses, generation = gen.next()
    assert [r.uid for r in responses] == [short_uid]  # joined; no piece of the long prompt
    assert [r.uid for r in generation] == [short_uid]  # its first token, in this step
    (second,) = gen.insert_segments([[tokenizer.encode("A small")]], max_tokens=[3])
    responses, _ = gen.next()
    assert [r.uid for r in responses] == [long_uid, second]  # the long prompt's turn first
    done, total = responses[0].progress
    assert 0 < done < total


def test_a_fresh_prompt_longer_than_the_probe_joins_whole_once_a_join_is_measured() -> None:
    gen, tokenizer = generator(budget_s=5.0)
    long_prompt = tokenizer.encode(" ".join(["The old king walked the long road home."] * 40))
    (long_uid,) = gen.insert_segments([[long_prompt]], max_tokens=[1])
    gen.next()
    first = tokenizer.encode("Once upon a time, the old king walked the long road home.")  # within the probe
    (first_uid,) = gen.insert_segments([[first]], max_tokens=[3])
    responses, _ = gen.next()
    assert [r.uid for r in responses] == [first_uid]
    assert gen.budget.fresh is not None and gen.budget.fresh[1] == len(first)  # the join priced
    gen.next()  # the long prompt's turn
    medium = tokenizer.encode(
        "A small fox ran across the field and into the wood, where the old king walked the long road home."
    )
    assert PROBE < len(medium) <= 2 * len(first)
    (medium_uid,) = gen.insert_segments([[medium]], max_tokens=[3])
    responses, generation = gen.next()
    assert [r.uid for r in responses] == [medium_uid]  # whole, in one step: no probe first
    assert medium_uid in [r.uid for r in generation]
    assert gen.budget.fresh[1] == len(medium)
