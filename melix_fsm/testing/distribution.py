"""The distribution property: sampled tokens, position by position, against the target's probabilities.

Rules of this module:
- Greedy exactness cannot see a biased acceptance rule (for example one uniform shared by
  all k >= 2 drafts of a cycle): its output is still made of tokens the target could
  produce, only in the wrong proportions. This property draws many continuations of one
  prompt and compares, at every position j, the tokens drawn after each prefix with the
  target's own probabilities p(. | prompt + prefix).
- Two tests per position j. (1) A G-test per (position, prefix) group with at least
  `min_group` draws, observed counts against the target's expected counts; categories
  whose expected count is under 5 are pooled (the chi-square approximation needs it);
  the G statistics and degrees of freedom of a position's groups add up (the groups are
  disjoint draws). (2) A mean-probability z-test over every draw: under the target, the
  probability p(t | prefix) of a drawn token t has mean sum(p^2) and variance
  sum(p^3) - sum(p^2)^2, whatever the prefix, so the standardized sum over all draws is
  normal (only the `max_groups` largest prefix groups with `min_draws` or more draws
  enter: the selection depends on earlier tokens alone, so the test stays valid, and the
  target's forwards stay bounded). An acceptance rule that lets over-proposed drafts through (q > p, a shared
  uniform) draws tokens the target finds too unlikely, which this test sees even when
  the draws spread over many small prefix groups. Each test fails below
  `alpha / (number of tests)` (Bonferroni): the stated false-alarm rate of a whole
  check is at most `alpha` (default 0.001) for a correct generator, up to the chi-square
  and normal approximations.
- A drawn token with target probability exactly 0 fails (`impossible_token`).
- `measure_distribution` computes every position's statistics and never raises (the
  report shows them even when the check fails); `check_distribution` raises on a miss.
- `draw_with_restarts` keeps drawing when the generator crashes: every token drawn
  before a crash stays (a draw cut short still samples its first positions), a fresh
  generator draws the rest, and the crashes are returned for the report, so the
  statistics exist even for a generator with a sampling-path crash.
- `draw_continuations` gets the draws through the same surfaces as the exactness run and
  feeds a `ReportMirror` when the generator reports, so lifecycle events are checked
  under sampling too. Every failure is a `ConformanceError`.
- Pure core: no mlx, no numpy (the chi-square tail is the regularized gamma function).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .mirror import ConformanceError, ReportMirror
from .surfaces import as_surface

# contexts (all of one length) -> the target's probabilities after each, in order
Probabilities = Callable[[list[tuple[int, ...]]], Sequence[Sequence[float]]]
MIN_EXPECTED = 5.0


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable with `df` degrees of freedom."""
    if df <= 0:
        return 1.0
    if x <= 0:
        return 1.0
    return _upper_gamma(df / 2.0, x / 2.0)


def _upper_gamma(a: float, x: float) -> float:
    """The regularized upper incomplete gamma function Q(a, x)."""
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:  # the series for P converges fast here
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300  # the continued fraction for Q (modified Lentz)
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        step = d * c
        h *= step
        if abs(step - 1.0) < 1e-15:
            break
    return min(1.0, math.exp(log_front) * h)


def g_statistic(observed: Counter[int], probs: Sequence[float]) -> tuple[float, int]:
    """(G, degrees of freedom) of `observed` counts against `probs`, small categories pooled."""
    n = sum(observed.values())
    expected = sorted(((p * n, t) for t, p in enumerate(probs) if p > 0), reverse=True)
    bins = [(e, observed.get(t, 0)) for e, t in expected if e >= MIN_EXPECTED]
    rest_e = sum(e for e, _ in expected if e < MIN_EXPECTED)
    rest_o = n - sum(o for _, o in bins)
    if rest_e > 0 or rest_o > 0:
        if rest_e >= MIN_EXPECTED or not bins:
            bins.append((rest_e, rest_o))
        else:  # too small to stand alone: merge it into the smallest bin
            e, o = bins.pop()
            bins.append((e + rest_e, o + rest_o))
    if len(bins) < 2:
        return 0.0, 0
    g = 2.0 * sum(o * math.log(o / e) for e, o in bins if o > 0)
    return g, len(bins) - 1


def normal_two_sided(z: float) -> float:
    """P(|Z| >= |z|) for a standard normal Z."""
    return math.erfc(abs(z) / math.sqrt(2.0))


@dataclass
class PositionResult:
    position: int
    draws: int = 0  # in the G-test's prefix groups
    groups: int = 0
    reached: int = 0  # draws that got this far
    g: float = 0.0
    df: int = 0
    p_value: float = 1.0  # the G-test's
    z: float = 0.0
    z_p_value: float = 1.0  # the mean-probability test's
    _sum: float = 0.0
    _var: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "draws": self.reached,
            "draws_tested": self.draws,
            "prefix_groups": self.groups,
            "G": round(self.g, 3),
            "df": self.df,
            "p_value": self.p_value,
            "z_mean_probability": round(self.z, 3),
            "z_p_value": self.z_p_value,
        }


@dataclass
class DistributionResult:
    prompt: tuple[int, ...]
    draws: int
    alpha: float
    positions: list[PositionResult] = field(default_factory=list)
    impossible: str = ""  # the first drawn token of probability 0, described
    crashes: int = 0  # generator restarts while drawing (draw_with_restarts)

    @property
    def tests(self) -> int:
        return sum((p.df > 0) + (p._var > 0) for p in self.positions)

    @property
    def threshold(self) -> float:
        return self.alpha / max(self.tests, 1)

    def failing(self) -> list[PositionResult]:
        return [p for p in self.positions if min(p.p_value, p.z_p_value) < self.threshold]

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt": list(self.prompt),
            "draws": self.draws,
            "alpha": self.alpha,
            "per_position_threshold": self.threshold,
            "generator_restarts": self.crashes,
            "impossible_token": self.impossible or None,
            "positions": [p.as_dict() for p in self.positions],
        }


def check_distribution(
    samples: Sequence[Sequence[int]],
    probs_of: Probabilities,
    prompt: Sequence[int],
    **options: Any,
) -> DistributionResult:
    """`measure_distribution`, raising a ConformanceError on a miss (see the module rules)."""
    result = measure_distribution(samples, probs_of, prompt, **options)
    if result.impossible:
        where = result.impossible.split(" after")[0]  # "position j"
        raise ConformanceError("impossible_token", result.impossible, where=where)
    for row in result.failing():
        raise ConformanceError(
            "sampled_distribution",
            f"position {row.position}: G = {row.g:.1f} on {row.df} degrees of freedom over "
            f"{row.draws} draws in {row.groups} prefix groups (p = {row.p_value:.3g}); mean target "
            f"probability of the drawn tokens z = {row.z:.2f} (p = {row.z_p_value:.3g}); threshold "
            f"{result.threshold:.3g} (alpha {result.alpha} over {result.tests} tests)",
            where=f"position {row.position}",
        )
    return result


def measure_distribution(
    samples: Sequence[Sequence[int]],
    probs_of: Probabilities,
    prompt: Sequence[int],
    *,
    alpha: float = 1e-3,
    min_group: int = 40,
    min_draws: int = 5,
    max_groups: int = 256,
    positions: int = 0,
) -> DistributionResult:
    """Test every position of `samples` (continuations of `prompt`); never raises.

    `positions`: report at least this many positions (those no draw reached show 0 draws).

    `probs_of(contexts)` answers a whole position's prefixes at once (one batched forward).
    Per position, only the `max_groups` largest prefix groups of at least `min_draws`
    draws are tested (the z-test), and of those only groups of `min_group` or more get a
    G-test.
    """
    prompt = tuple(int(t) for t in prompt)
    length = max(max((len(s) for s in samples), default=0), positions)
    result = DistributionResult(prompt, len(samples), alpha)
    for j in range(length):
        groups: dict[tuple[int, ...], Counter[int]] = {}
        for s in samples:
            if len(s) > j:
                groups.setdefault(tuple(s[:j]), Counter())[int(s[j])] += 1
        row = PositionResult(j, reached=sum(len(s) > j for s in samples))
        # the largest groups only: which prefixes are tested depends on earlier tokens alone,
        # so the tests stay valid, and the target's forwards stay bounded
        ranked = sorted(groups, key=lambda prefix: -sum(groups[prefix].values()))
        prefixes = [p for p in ranked if sum(groups[p].values()) >= min_draws][:max_groups]
        answers = probs_of([prompt + prefix for prefix in prefixes]) if prefixes else []
        for prefix, probs in zip(prefixes, answers):
            counts = groups[prefix]
            n = sum(counts.values())
            squares = sum(p * p for p in probs)
            row._var += n * (sum(p * p * p for p in probs) - squares * squares)
            row._sum += (
                sum(c * (probs[t] if t < len(probs) else 0.0) for t, c in counts.items()) - n * squares
            )
            if n < min_group:
                continue
            for token in counts:
                if (token >= len(probs) or probs[token] == 0.0) and not result.impossible:
                    result.impossible = (
                        f"position {j} after prefix {list(prefix)}: token {token} was drawn "
                        f"{counts[token]} times but has probability 0 under the target"
                    )
            g, df = g_statistic(counts, probs)
            if df:
                row.draws += n
                row.groups += 1
                row.g += g
                row.df += df
        row.p_value = chi2_sf(row.g, row.df) if row.df else 1.0
        if row._var > 0:
            row.z = row._sum / math.sqrt(row._var)
            row.z_p_value = normal_two_sided(row.z)
        result.positions.append(row)
    return result


def draw_continuations(
    generator: Any,
    prompt: Sequence[int],
    draws: int,
    length: int,
    *,
    per_insert: int = 64,
    surface: str = "auto",
    make_stops: Any = None,
) -> list[tuple[int, ...]]:
    """`draws` continuations of `prompt`, `length` tokens each, from one generator."""
    samples, err = _draw(generator, prompt, draws, length, per_insert, surface, make_stops)
    if err is not None:
        raise err
    return samples


def draw_with_restarts(
    make_generator: Callable[[], Any],
    prompt: Sequence[int],
    draws: int,
    length: int,
    *,
    per_insert: int = 64,
    surface: str = "auto",
    make_stops: Any = None,
    max_restarts: int = 12,
) -> tuple[list[tuple[int, ...]], list[ConformanceError]]:
    """Draws that survive the generator's crashes, and the crashes (see the module rules).

    After each crash the next generator gets half as many draws at a time (down to one):
    crashes of reshapes (rows finishing while others continue) then get rarer.
    """
    samples: list[tuple[int, ...]] = []
    crashes: list[ConformanceError] = []
    while len(samples) < draws and len(crashes) <= max_restarts:
        wanted = draws - len(samples)
        got, err = _draw(make_generator(), prompt, wanted, length, per_insert, surface, make_stops)
        samples += [s for s in got if s]  # a draw cut short still samples its first positions
        if err is None:
            break
        crashes.append(err)
        if not got:  # the crash came before any insert went through: retrying changes nothing
            break
        per_insert = max(1, per_insert // 2)
    return samples, crashes


def _draw(
    generator: Any,
    prompt: Sequence[int],
    draws: int,
    length: int,
    per_insert: int,
    surface: str,
    make_stops: Any,
) -> tuple[list[tuple[int, ...]], ConformanceError | None]:
    """Every inserted draw's tokens (cut short by a failure), and the failure."""
    s = as_surface(generator, surface, make_stops)
    mirror = ReportMirror() if s.report() is not None else None
    got: dict[Any, list[int]] = {}
    open_: set[Any] = set()
    spec = _Spec(tuple(int(t) for t in prompt), length)
    inserted = 0
    steps = 0
    limit = 16 + 4 * draws * length
    try:
        while inserted < draws or open_:
            if inserted < draws and len(open_) < per_insert:
                n = min(per_insert - len(open_), draws - inserted)
                uids = _call(lambda n=n: s.insert([spec] * n))
                open_.update(uids)
                for uid in uids:
                    got[uid] = []
                inserted += n
            emissions = _call(s.step)
            finished = [e.uid for e in emissions if e.finish_reason is not None]
            if mirror is not None:
                mirror.observe(s.report(), finished)
            for e in emissions:
                if e.uid not in open_:
                    raise ConformanceError(
                        "unknown_uid", f"a token for uid {e.uid!r}, which is not generating", e.uid
                    )
                got[e.uid].append(e.token)
            open_.difference_update(finished)
            steps += 1
            if steps > limit:
                raise ConformanceError("completion", f"{len(open_)} draws still open after {limit} steps")
    except ConformanceError as err:
        return [tuple(tokens) for tokens in got.values()], err
    return [tuple(tokens) for tokens in got.values()], None


@dataclass(frozen=True)
class _Spec:
    prompt: tuple[int, ...]
    max_tokens: int
    stops: tuple[tuple[int, ...], ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


def _call(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ConformanceError:
        raise
    except Exception as exc:
        raise ConformanceError("generator_raised", f"{type(exc).__name__}: {exc}", where="sampling") from exc
