"""Batch-invariance oracles on toy generators: neighbours change nothing, or only near-ties.

Rules of this file:
- The correct padded toy generator is batch-invariant bit-exactly: every case holds
  without a judge and meets no near-tie.
- A generator whose verify rounds differently only in batches of more than one row (the
  simulated regime, planted_generators' `noisy_next`) is within the contract with a
  judge (near-ties, no bug) and fails without one.
- Planted batch-dependence bugs fail their case even under the contract: unmasked left
  padding (the prompt beside longer neighbours) and stale rejection masks inherited on a
  join (the prompt joining a running batch).
"""

from __future__ import annotations

from typing import Any

from melix_fsm.testing.divergence import judge_for
from melix_fsm.testing.invariance import alone_reference, check_batch_invariance, invariance_cases

from .planted_generators import PaddedToyGenerator, noisy_next, planted, toy_logits
from .toy_generator import toy_next, toy_stops

PROMPT, NEIGHBOURS, OTHERS = [5, 9], [[3, 4, 7, 8], [11]], [[6, 6, 6], [12, 4]]


class NoisyWhenBatched(PaddedToyGenerator):
    """Its verify rounds differently whenever more than one row shares the step."""

    def next(self) -> Any:
        self.verify_next = noisy_next if len(self.rows) > 1 else toy_next
        return super().next()


def run(factory: Any, judge: Any = None, n: int = 12) -> dict[str, Any]:
    results = check_batch_invariance(
        factory, PROMPT, NEIGHBOURS, OTHERS, n, judge=judge, make_stops=toy_stops
    )
    return {r.name: r for r in results}


def test_cases_cover_every_position_other_neighbours_and_a_join() -> None:
    names = [name for name, _ in invariance_cases(PROMPT, NEIGHBOURS, OTHERS, 5)]
    assert names == [
        "position 0 of 3",
        "position 1 of 3",
        "position 2 of 3",
        "other neighbours",
        "joins running batch after 1 step(s)",
        "joins running batch after 3 step(s)",
    ]


def test_the_correct_generator_is_bit_exact() -> None:
    results = run(planted())
    assert {r.verdict for r in results.values()} == {"bit-exact"}, {
        k: str(r.error) for k, r in results.items()
    }


def test_batch_dependent_rounding_is_within_the_contract_and_a_bug_without_it() -> None:
    judged = run(NoisyWhenBatched, judge_for(toy_logits, "bfloat16"), n=16)
    verdicts = {r.verdict for r in judged.values()}
    assert "FAIL" not in verdicts and "within contract" in verdicts, {
        k: str(r.error) for k, r in judged.items()
    }
    strict = run(NoisyWhenBatched, n=16)
    assert any(r.verdict == "FAIL" for r in strict.values())


def test_planted_batch_dependence_fails_its_case_under_the_contract() -> None:
    padding = run(planted("unmasked_left_padding"), judge_for(toy_logits, "bfloat16"))
    assert padding["position 0 of 3"].verdict == "FAIL"
    assert padding["position 0 of 3"].error.divergence.kind == "bug"
    stale = run(planted("stale_mask_on_extend"), judge_for(toy_logits, "bfloat16"))
    assert stale["joins running batch after 1 step(s)"].verdict == "FAIL"
    assert stale["position 1 of 3"].verdict == "bit-exact"


def test_the_alone_oracle_is_the_generator_alone() -> None:
    oracle = alone_reference(planted(), make_stops=toy_stops)
    from .toy_generator import toy_reference

    assert oracle((5, 9), 7) == toy_reference((5, 9), 7)
