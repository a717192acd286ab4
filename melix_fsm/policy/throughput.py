"""Live throughput and acceptance estimates, from measured step times (pure, no clock).

Rules of this module:
- The caller times its decode steps and passes the seconds; nothing here reads a clock,
  so every estimate is a pure function of the samples fed in (deterministic, testable
  with synthetic timings, identical on every rank fed the same numbers).
- A throughput is a ratio of sums (tokens / seconds over a window), not a mean of per-step
  rates: a mean of rates over-weights fast steps and is biased for a speculative cycle,
  whose token count varies from step to step. The sums forget geometrically (`decay` per
  sample), so the window follows a changing workload without a fixed-size buffer.
- The noise estimate (relative standard error of the per-step rates) is only used to call
  two rates a tie: a difference inside the noise is not evidence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PRIOR_CV = 0.25  # per-step spread assumed before the samples show theirs
PRIOR_WEIGHT = 2.0


class Rate:
    """Exponentially forgetting throughput of one kind of step (plain, or depth k)."""

    __slots__ = ("decay", "tokens", "seconds", "n", "_w", "_w2", "_mean", "_m2")

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        """Forget everything: a probe's window must be its own evidence, not a stale mix."""
        self.tokens = 0.0
        self.seconds = 0.0
        self.n = 0  # samples since the last reset (not decayed): "measured at all?"
        self._w = 0.0  # decayed sum of weights (1 per sample)
        self._w2 = 0.0  # decayed sum of squared weights, for the effective sample size
        self._mean = 0.0  # decayed mean of per-step rates
        self._m2 = 0.0  # decayed sum of squared deviations of per-step rates

    def add(self, tokens: float, seconds: float) -> None:
        d = self.decay
        self.tokens = d * self.tokens + tokens
        self.seconds = d * self.seconds + seconds
        self.n += 1
        # West's weighted incremental variance, with the old weights decayed first.
        x = tokens / seconds
        self._w = d * self._w + 1.0
        self._w2 = d * d * self._w2 + 1.0
        self._m2 *= d
        delta = x - self._mean
        self._mean += delta / self._w
        self._m2 += delta * (x - self._mean)

    @property
    def value(self) -> float | None:
        """Tokens per second over the forgetting window; None before any sample."""
        return self.tokens / self.seconds if self.n and self.seconds > 0 else None

    @property
    def relative_noise(self) -> float:
        """Relative standard error of the windowed rate (inf with fewer than 2 samples)."""
        if self.n < 2 or self._mean <= 0:
            return math.inf
        n_eff = self._w * self._w / self._w2
        # Shrink towards a prior spread (PRIOR_CV over PRIOR_WEIGHT pseudo-samples): a few
        # samples that happen to agree must not look like a precise measurement.
        prior_var = (PRIOR_CV * self._mean) ** 2
        var = (max(self._m2, 0.0) + PRIOR_WEIGHT * prior_var) / (self._w + PRIOR_WEIGHT)
        return math.sqrt(var / n_eff) / self._mean


class PositionAcceptance:
    """P(draft p accepted) per draft position p = 1..max_k, forgetting geometrically.

    `accepted[p]` counts drafts accepted at position p (summed over rows); `offered[p]`
    counts row-cycles that drafted position p. E[tokens per cycle at depth k] is
    1 + sum_{p<=k} P(p): exact in expectation for any acceptance pattern.
    """

    def __init__(self, max_k: int, decay: float, prior: float) -> None:
        self.max_k = max_k
        self.decay = decay
        self.prior = prior  # per-draft acceptance under the chained geometric model
        self.reset()

    def reset(self) -> None:
        """Forget the counts (a probe after a suspension: the stale ones caused it)."""
        self.accepted = [0.0] * (self.max_k + 1)  # index 0 unused
        self.offered = [0.0] * (self.max_k + 1)

    def observe(self, per_position: Sequence[int], rows: int) -> None:
        d = self.decay
        for p in range(1, self.max_k + 1):
            self.accepted[p] *= d
            self.offered[p] *= d
        for p, count in enumerate(per_position[: self.max_k], start=1):
            self.accepted[p] += count
            self.offered[p] += rows

    def observe_rate(self, accepted: int, proposed: int, k: int, rows: int) -> None:
        """Without per-position counts: spread accepted/proposed as a chained geometric."""
        if not proposed:
            return
        a = _geometric_acceptance(accepted / proposed, k)
        self.observe([round(rows * a**p) for p in range(1, k + 1)], rows)

    def positions(self, k: int) -> list[float]:
        """[P(1), ..., P(k)]: measured where offered, else continued from the last ones.

        An unmeasured position continues the last conditional rate P(p-1) / P(p-2) (the
        chain needs every earlier draft), or starts from the prior per-draft acceptance.
        """
        out: list[float] = []
        for p in range(1, k + 1):
            if p <= self.max_k and self.offered[p] > 0.5:
                out.append(self.accepted[p] / self.offered[p])
            elif p == 1:
                out.append(self.prior)
            else:
                before = out[-2] if p > 2 else 1.0
                conditional = out[-1] / before if before > 0 else 0.0
                out.append(out[-1] * min(conditional, 1.0))
        return out

    def position(self, p: int) -> float:
        return self.positions(p)[-1]

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.positions(k))

    def measured(self, p: int) -> bool:
        return self.offered[p] > 0.5

    def summary(self) -> list[float]:
        return self.positions(self.max_k)

    def optimistic_tokens(self, k: int, z: float) -> float:
        """E[tokens per cycle at depth k] at the optimistic end of what was measured: each
        position's Wilson upper bound at z standard errors (1.0 where none was offered),
        with the forgetting counts as the sample size. Below it, acceptance alone says a
        cycle yields fewer tokens, whatever the noise of so few drafts."""
        total = 1.0
        for p in range(1, k + 1):
            n = self.offered[p] if p <= self.max_k else 0.0
            total += _wilson_upper(self.accepted[p], n, z) if n > 0.5 else 1.0
        return total


def _geometric_acceptance(rate: float, k: int) -> float:
    """The per-draft a whose chained geometric gives accepted/proposed = rate at depth k."""
    if k == 1:
        return rate
    lo, hi = 0.0, 1.0
    for _ in range(40):  # (sum_{i=1..k} a^i) / k is increasing in a: bisect
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, k + 1)) / k < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _wilson_upper(successes: float, n: float, z: float) -> float:
    """The Wilson score interval's upper end for a binomial rate (sound at 0 and 1)."""
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0))
    return min((centre + spread) / (1 + z * z / n), 1.0)
