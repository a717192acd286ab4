"""A short prompt joins without waiting for a segment of a long one, and the long one goes on.

The serving generator's step runs the rows' decode, the segment stage (a time-budgeted
piece of each long prompt) and the admission of prompts ready to join. A step in which a
short prompt joins runs its segment stage after the join, on what the join left of the
budget: the short prompt's first token waits for no segment, and the long prompt still
progresses in that step. Driven directly on the generator, with the embedded checkpoint.
"""

from __future__ import annotations

from typing import Any

import pytest
from melix_mlx.loading.checkpoints import EMBEDDED

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


def test_a_joining_step_admits_the_short_prompt_and_prefills_the_long_one() -> None:
    gen, tokenizer = generator(budget_s=5.0)  # a budget no join on this machine exhausts
    long_prompt = tokenizer.encode(" ".join(["The old king walked the long road home."] * 40))
    (long_uid,) = gen.insert_segments([[long_prompt]], max_tokens=[1])
    for _ in range(2):  # the long prompt's first pieces (its probe, then a measured piece)
        responses, _ = gen.next()
        assert [r.uid for r in responses] == [long_uid]
    before = gen.budget.rates[long_uid]
    (short_uid,) = gen.insert([tokenizer.encode("Once upon")], max_tokens=[3])
    responses, generation = gen.next()
    by_uid = {r.uid: r for r in responses}
    assert list(by_uid) == [short_uid, long_uid], by_uid  # joined, THEN the long prompt went on
    assert [r.uid for r in generation] == [short_uid]  # the short prompt's first token, this step
    done, total = by_uid[long_uid].progress
    assert 0 < done < total and gen.budget.rates[long_uid] != before


def test_a_join_that_takes_the_whole_budget_lets_the_long_prompt_go_first_next() -> None:
    """Progress under a stream of joins: a join that used up the step's budget skips that
    step's segment stage, and the next step's segment stage runs before any join."""
    gen, tokenizer = generator(budget_s=1e-6)  # every join takes the whole budget
    long_prompt = tokenizer.encode(" ".join(["The old king walked the long road home."] * 40))
    (long_uid,) = gen.insert_segments([[long_prompt]], max_tokens=[1])
    gen.next()
    (first,) = gen.insert([tokenizer.encode("Once upon")], max_tokens=[8])
    responses, _ = gen.next()
    assert [r.uid for r in responses] == [first]  # joined; no budget left for a segment
    (second,) = gen.insert([tokenizer.encode("A small")], max_tokens=[8])
    responses, _ = gen.next()
    assert [r.uid for r in responses] == [long_uid, second]  # the long prompt's segment first
