"""The distribution property: a planted biased acceptance rule is caught, a correct sampler passes.

Rules of this file:
- sampled_toy.py is a speculative sampler with k = 2 drafts per cycle; `shared_uniform`
  plants one uniform shared by both drafts (the bias a peer shipped). At the kit's
  stated false-alarm rate (alpha = 0.001) and 2000 draws, the biased rule must be caught
  on every seed tried, at a draft position after the first.
- The correct rule must pass at the stated rate: over 30 independent runs at alpha =
  0.05 (so that a rate is measurable in seconds), at most 5 false alarms (the binomial
  upper tail at 0.05 x 30 = 1.5 expected is below 2% for >= 5).
- The chi-square tail is checked against known values; impossible tokens fail at once.
- No mlx.
"""

from __future__ import annotations

from collections import Counter

import pytest

from melix_fsm.testing.distribution import (
    check_distribution,
    chi2_sf,
    draw_continuations,
    g_statistic,
)
from melix_fsm.testing.mirror import ConformanceError

from .sampled_toy import SampledToy, toy_probs_batch
from .toy_generator import toy_stops

PROMPT = [1, 2]


def draws(shared: bool, seed: int, n: int = 2000) -> list[tuple[int, ...]]:
    return draw_continuations(
        SampledToy(shared_uniform=shared, seed=seed), PROMPT, n, 3, per_insert=500, make_stops=toy_stops
    )


def test_chi2_tail_matches_known_values() -> None:
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(124.342113, 100) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(0.0, 3) == 1.0 and chi2_sf(1e4, 3) < 1e-300 + 1e-12


def test_g_statistic_pools_small_categories() -> None:
    g, df = g_statistic(Counter({0: 50, 1: 50}), [0.5, 0.5, 0.0])
    assert g == pytest.approx(0.0) and df == 1
    _, df = g_statistic(Counter({0: 88, 1: 12}), [0.9, 0.04, 0.03, 0.03])
    assert df == 1  # three tiny categories pooled into one "rest" bin


@pytest.mark.parametrize("seed", range(4))
def test_shared_uniform_is_caught(seed: int) -> None:
    with pytest.raises(ConformanceError) as info:
        check_distribution(draws(True, seed), toy_probs_batch, PROMPT, alpha=1e-3)
    assert info.value.prop == "sampled_distribution"
    assert info.value.where == "position 2"  # the second draft: the first one's acceptance is still fair


def test_correct_rule_passes_at_the_stated_rate() -> None:
    alarms = 0
    for seed in range(30):
        try:
            result = check_distribution(draws(False, 100 + seed), toy_probs_batch, PROMPT, alpha=0.05)
        except ConformanceError:
            alarms += 1
        else:
            assert result.positions and all(p.df > 0 for p in result.positions)
    assert alarms <= 5


def test_impossible_token_fails_at_once() -> None:
    samples = [(0,)] * 50 + [(7,)]
    with pytest.raises(ConformanceError) as info:
        check_distribution(samples, lambda cs: [[1.0] + [0.0] * 7 for _ in cs], PROMPT)
    assert info.value.prop == "impossible_token" and "token 7" in str(info.value)
