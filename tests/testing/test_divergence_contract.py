"""The divergence contract on toy generators: near-ties counted, bugs still bugs; no mlx.

Rules of this file:
- The simulated rounding regime is planted_generators' `verify_noise`: the verify's
  logits are perturbed by up to half the contract's bfloat16 bound, so only near-ties
  can flip. Under it, the correct generator must come out with zero bugs and its
  near-ties counted (and without the contract, the same run is a false alarm: the
  contract is what tells them apart).
- Every planted cycle bug (off-by-one acceptance, stale row after filter, wrong
  rollback) and the two planted wrong-token classes must still come out as bugs under
  the simulated regime, each with a measured gap far above the bound.
- The contract's arithmetic (scale, bound, histogram, rate) is checked on its own.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import settings

from melix_fsm.testing import PROFILES
from melix_fsm.testing.divergence import (
    BUG,
    NEAR_TIE,
    DivergenceLedger,
    RoundingContract,
    judge_for,
)
from melix_fsm.testing.hunt import hunt_bugs
from melix_fsm.testing.qa import run_session

from .planted_generators import CYCLE_BUGS, planted, toy_logits
from .toy_generator import toy_reference, toy_stops

TOY = {"make_stops": toy_stops, "tokens": (3, 12), "prompt_lengths": (1, 4), "max_tokens": (4, 8)}


def judge() -> object:
    return judge_for(toy_logits, "bfloat16")


def hunt(generator: type, seed: int, **options: object) -> object:
    budget = settings(PROFILES["quick"], max_examples=25)
    return hunt_bugs(generator, toy_reference, settings=budget, seed=seed, max_rounds=3, **TOY, **options)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_correct_generator_under_simulated_rounding_has_no_bugs_and_counts_near_ties(seed: int) -> None:
    j = judge()
    result = hunt(planted(verify_noise=True), seed, judge=j)
    assert result.bugs == [], [b.detail for b in result.bugs]
    ledger = j.ledger
    assert ledger.count(NEAR_TIE) > 0 and ledger.count(BUG) == 0, ledger.as_dict()
    assert ledger.tokens > 100 and 0 < ledger.per_1000() < 1000
    assert all(d.ulps <= 8 for d in ledger.divergences)


def test_without_the_contract_the_same_regime_is_a_false_alarm() -> None:
    result = hunt(planted(verify_noise=True), 0)
    assert [b.prop for b in result.bugs][:1] == ["tokens_match_reference"]


def test_the_correct_generator_without_noise_never_diverges() -> None:
    j = judge()
    assert hunt(planted(), 0, judge=j).bugs == []
    assert j.ledger.divergences == [] and j.ledger.tokens > 100


@pytest.mark.parametrize("bug", [*CYCLE_BUGS, "stale_mask_on_extend", "unmasked_left_padding"])
def test_planted_bugs_stay_bugs_under_simulated_rounding(bug: str) -> None:
    j = judge()
    result = hunt(planted(bug, verify_noise=True), 0, judge=j)
    wrong = [b for b in result.bugs if b.prop == "tokens_match_reference"]
    assert wrong, [str(b.signature) for b in result.bugs]
    found = wrong[0].divergence
    assert found is not None and found.kind == BUG and found.ulps > 8, found
    assert "bug" in wrong[0].detail and "ulps" in wrong[0].detail
    assert j.ledger.count(BUG) >= 1


def test_the_qa_report_carries_the_rate_and_histogram() -> None:
    j = judge()
    make = lambda temperature: planted(verify_noise=True)()  # noqa: E731
    options = {"settings": settings(PROFILES["quick"], max_examples=10), "max_rounds": 1, "judge": j, **TOY}
    report = run_session(
        make,
        toy_reference,
        settings={"seed": 3, "temperature": 0.0, "target": "toy", "model": "toy"},
        hunt_options=options,
    )
    data = report.as_dict()["divergence"]
    assert data["bugs"] == 0 and data["near_ties"] == j.ledger.count(NEAR_TIE) > 0
    rate = 1000 * data["near_ties"] / data["tokens_compared"]
    assert data["per_1000_tokens"]["near_tie"] == pytest.approx(rate)
    assert sum(b["count"] for b in data["histogram"]) == data["divergences"]
    assert data["contract"]["dtype"] == "bfloat16" and data["contract"]["ulps"] == 8
    text = report.text()
    assert "near-tie(s)" in text and "per 1,000" in text and "gaps in ulps" in text
    assert report.exit_code == 0


def test_contract_arithmetic() -> None:
    c = RoundingContract("bfloat16")
    assert c.eps == 2.0**-7 and c.scale(-10.0) == 10 * 2.0**-7
    with pytest.raises(ValueError):
        RoundingContract("int8")
    with pytest.raises(ValueError):
        RoundingContract("float32", ulps=0)
    j = judge_for(lambda context: [0.0, 5.0, 5.0 - 0.3, -5.0], "bfloat16")
    tie = j.judge((1,), (), 1, 2)
    far = j.judge((1,), (), 1, 3)
    assert tie.kind == NEAR_TIE and tie.margin == pytest.approx(0.3) and tie.ulps == pytest.approx(7.68)
    assert far.kind == BUG and far.gap == 10.0
    assert j.judge((1,), (), 1, 99).gap == math.inf  # outside the vocabulary: a bug
    strict = judge_for(lambda context: [5.0, 5.0 - 0.3], "float32")
    assert strict.judge((1,), (), 0, 1).kind == BUG  # the same gap is no rounding matter in float32
    ledger: DivergenceLedger = j.ledger
    assert ledger.tokens == 0 and ledger.per_1000() == 0.0
    ledger.add_tokens(500)
    assert ledger.per_1000(NEAR_TIE) == 2.0 and ledger.per_1000(BUG) == 4.0
    counts = {b["ulps"]: b["count"] for b in ledger.histogram()}
    assert counts["4-8"] == 1 and counts[">=1024"] == 1 and counts["64-1024"] == 1
    assert j.silent().ledger is None
