"""The cost model: what one speculative cycle costs and emits, from measured timings.

Rules of this module:
- Pure and sans-IO: no mlx, no clock. Timings are inputs (melix_fsm.policy.calibration
  measures them; the adapters build the timed forwards). Same inputs, same outputs.
- Plain decode costs t_1 a token. A speculative cycle costs one verify over k+1 tokens
  plus k head drafts and emits E tokens, so
      predicted speedup = E / ((t_verify + k * t_head) / t_1),
  E = 1 + sum of per-position acceptances (exact for any acceptance pattern) or, from a
  per-draft acceptance a under the chained geometric model, E = sum_{i=0..k} a^i.
- `TimingTable` holds timings calibrated at a few batch sizes and estimates the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from .errors import PolicyError
from .telemetry import Regime

# ---- value types ------------------------------------------------------------------


class CycleForwards(msgspec.Struct, frozen=True, kw_only=True):
    """The forwards one speculative cycle runs, as counts per cycle (rates may be fractional).

    verify: target verifies (1). head: head draft steps (None: k, one per draft).
    replay: target forwards that rebuild recurrent state after a rejection, per cycle: an
    engine that restores a pre-verify checkpoint and re-runs the kept tokens replays on
    every rejecting cycle (`replay_rate`); one that captures the state inside the verify
    replays never (0). The cost model is only true if this list is.
    """

    verify: float = 1.0
    head: float | None = None
    replay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("verify", "head", "replay"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0.0):
                raise PolicyError(f"cycle forwards: {name} must be a finite count >= 0, got {value!r}")


def replay_rate(acceptance: float, k: int, rows: int = 1) -> float:
    """Replays per cycle of a restore-and-replay engine: P(some row rejects a draft).

    A row keeps all k chained drafts with probability a^k; one rejecting row replays the
    whole batch, so the batch replays unless every row kept everything.
    """
    return 1.0 - acceptance ** (k * rows)


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """Median forward times (seconds) at one batch size, as calibration measured them.

    t_1: one decode step (B rows x 1 token). t_verify: one verify (B rows x k+1 tokens).
    t_head: one head draft step (B rows x 1 token), per draft token.
    spread: the largest relative median absolute deviation of the three sample sets.
    """

    t_1: float
    t_verify: float
    t_head: float
    k: int
    batch_size: int = 1
    runs: int = 0
    spread: float = 0.0
    note: str = ""
    t_replay: float | None = None  # one replay forward; None: priced as a verify (an upper bound)
    remeasured: str = ""  # why the first measurement was refused and this one taken ("": measured once)

    def __post_init__(self) -> None:
        for name in ("t_1", "t_verify", "t_head", "t_replay"):
            value = getattr(self, name)
            if value is None and name == "t_replay":
                continue
            if not (math.isfinite(value) and value >= 0.0) or (name in ("t_1", "t_verify") and value == 0.0):
                raise PolicyError(f"timings: {name} must be a finite positive time, got {value!r}")
        if self.k < 1 or self.batch_size < 1:
            raise PolicyError(f"timings: need k >= 1 and batch_size >= 1, got {self.k}, {self.batch_size}")

    @property
    def cycle_cost(self) -> float:
        """Cost of one speculative cycle in plain-decode steps: (t_verify + k t_head) / t_1."""
        return self.cost(CycleForwards())

    def cost(self, forwards: CycleForwards) -> float:
        """Cost of one cycle running `forwards`, in plain-decode steps (units of t_1).

        Every forward the cycle really runs is on the list: a model that leaves one out
        (the replay of recurrent caches) over-predicts the speedup.
        """
        head = self.k if forwards.head is None else forwards.head
        t_replay = self.t_verify if self.t_replay is None else self.t_replay
        seconds = forwards.verify * self.t_verify + head * self.t_head + forwards.replay * t_replay
        return seconds / self.t_1

    @property
    def marginal_token_cost(self) -> float:
        """Extra cost of each verified token beyond the first, in units of t_1."""
        return (self.t_verify / self.t_1 - 1.0) / self.k

    @property
    def regime(self) -> Regime:
        return regime_of(self.marginal_token_cost)


# Marginal cost per extra verified token (in t_1) at or below which a forward is
# bandwidth-bound, and at or above which it is compute-bound. The reference-BLAS float32
# wheel measures ~0.8, OpenBLAS ~0.0, bfloat16 ~0.25-0.4.
BANDWIDTH_BOUND_BELOW = 0.15
COMPUTE_BOUND_ABOVE = 0.5


def regime_of(marginal_token_cost: float) -> Regime:
    if marginal_token_cost <= BANDWIDTH_BOUND_BELOW:
        return Regime.bandwidth_bound
    if marginal_token_cost >= COMPUTE_BOUND_ABOVE:
        return Regime.compute_bound
    return Regime.intermediate


class AcceptancePrior(msgspec.Struct, frozen=True, kw_only=True):
    """Assumed per-draft acceptance before live counters exist."""

    name: str
    acceptance: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise PolicyError(f"prior {self.name!r}: acceptance must lie in [0, 1], got {self.acceptance}")


# Deliberately below published figures for trained, primed heads (DeepSeek-V3 reports
# 85-90% for its second token; oMLX reports 0.90 primed for Qwen3.5): a prior that is too
# optimistic would admit speculation the first measurement then has to undo.
FAMILY_PRIORS: dict[str, AcceptancePrior] = {
    "deepseek_v3": AcceptancePrior(name="deepseek_v3", acceptance=0.8),
    "qwen3_5": AcceptancePrior(name="qwen3_5", acceptance=0.75),
    "mimo": AcceptancePrior(name="mimo", acceptance=0.7),
}
GENERIC_PRIOR = AcceptancePrior(name="generic", acceptance=0.6)


def acceptance_prior(family: str | None) -> AcceptancePrior:
    return FAMILY_PRIORS.get(family or "", GENERIC_PRIOR)


# ---- cost model -----------------------------------------------------------------------


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a cycle emits when each chained draft is accepted with probability a."""
    return sum(acceptance**i for i in range(k + 1))


def expected_tokens_from_positions(per_position: Sequence[float]) -> float:
    """1 + sum of P(draft p accepted): `Counters.per_position_acceptance` gives these."""
    return 1.0 + sum(per_position)


def acceptance_rate_of(acceptance: float, k: int) -> float:
    """The fraction of proposed drafts accepted (accepted / proposed) the prior implies."""
    return (expected_tokens(acceptance, k) - 1.0) / k


def predicted_speedup(tokens_per_cycle: float, timings: Timings) -> float:
    return tokens_per_cycle / timings.cycle_cost

# ---- timings across batch sizes -----------------------------------------------------


class TimingTable(msgspec.Struct, frozen=True, kw_only=True):
    """Timings calibrated at a few batch sizes (one k), and estimates in between.

    Calibrated sizes return their own figures. Elsewhere the model treats one forward's
    cost as a curve f(n) of the tokens it processes (B for a decode step, B(k+1) for a
    verify), built from every measured point, made non-decreasing, and interpolated
    piecewise as a power law (log-log linear). Below the smallest measured n the first
    segment's slope continues (clamped to [0, 1]); beyond the largest one the slope is at
    least `beyond_slope` (1.0: as if compute-bound from there on, which is what larger
    batches tend towards, so extrapolation errs towards suspending: fail closed).
    The head draft keeps its measured cost relative to t_1 (interpolated in B).
    Calibrate at the batch sizes you run to avoid extrapolation.
    """

    entries: tuple[Timings, ...]
    beyond_slope: float = 1.0

    def __post_init__(self) -> None:
        if not self.entries:
            raise PolicyError("timing table: at least one calibrated batch size is needed")
        if len({t.k for t in self.entries}) != 1:
            raise PolicyError("timing table: every entry must share one k")
        if len({t.batch_size for t in self.entries}) != len(self.entries):
            raise PolicyError("timing table: one entry per batch size")

    @classmethod
    def of(cls, *timings: Timings, beyond_slope: float = 1.0) -> TimingTable:
        return cls(entries=tuple(sorted(timings, key=lambda t: t.batch_size)), beyond_slope=beyond_slope)

    @property
    def k(self) -> int:
        return self.entries[0].k

    def at(self, batch_size: int, k: int | None = None) -> tuple[Timings, bool]:
        """(timings at batch_size, whether they were extrapolated beyond measured points).

        k: the depth to price (default: the calibrated one). Another depth reads its
        verify, B(k+1) tokens, off the same cost curve; the 1-token step and the head
        keep their measured figures at a calibrated batch size.
        """
        k = self.k if k is None else k
        if k < 1:
            raise PolicyError(f"timing table: k must be >= 1, got {k}")
        points = _cost_curve(self.entries)
        for t in self.entries:
            if t.batch_size == batch_size:
                if k == t.k:
                    return t, False
                extrapolated = batch_size * (k + 1) > points[-1][0]
                t_verify = max(t.t_1, _curve_at(points, batch_size * (k + 1), self.beyond_slope))
                return msgspec.structs.replace(t, k=k, t_verify=t_verify, note="interpolated"), extrapolated
        n_lo, n_hi = points[0][0], points[-1][0]
        t_1 = _curve_at(points, batch_size, self.beyond_slope)
        t_verify = _curve_at(points, batch_size * (k + 1), self.beyond_slope)
        rho = _interp([(t.batch_size, t.t_head / t.t_1) for t in self.entries], batch_size)
        extrapolated = batch_size < n_lo or batch_size * (k + 1) > n_hi
        est = Timings(
            t_1=t_1,
            t_verify=t_verify,
            t_head=t_1 * rho,
            k=k,
            batch_size=batch_size,
            runs=0,
            spread=max(t.spread for t in self.entries),
            note="extrapolated" if extrapolated else "interpolated",
        )
        return est, extrapolated


def _cost_curve(entries: Sequence[Timings]) -> list[tuple[float, float]]:
    by_n: dict[int, float] = {}
    for t in entries:
        for n, cost in ((t.batch_size, t.t_1), (t.batch_size * (t.k + 1), t.t_verify)):
            by_n[n] = max(cost, by_n.get(n, 0.0))
    points: list[tuple[float, float]] = []
    running = 0.0
    for n in sorted(by_n):
        running = max(running, by_n[n])  # more tokens never cost less: absorb timing noise
        points.append((float(n), running))
    return points


def _slope(a: tuple[float, float], b: tuple[float, float]) -> float:
    return math.log(b[1] / a[1]) / math.log(b[0] / a[0])


def _curve_at(points: list[tuple[float, float]], n: float, beyond_slope: float) -> float:
    if len(points) == 1:
        (n0, c0) = points[0]
        return c0 * (n / n0) ** (beyond_slope if n > n0 else 0.0)
    if n <= points[0][0]:
        s = min(1.0, max(0.0, _slope(points[0], points[1])))
        return points[0][1] * (n / points[0][0]) ** s
    if n >= points[-1][0]:
        s = max(beyond_slope, _slope(points[-2], points[-1]))
        return points[-1][1] * (n / points[-1][0]) ** s
    for a, b in zip(points, points[1:]):
        if a[0] <= n <= b[0]:
            return a[1] * (n / a[0]) ** _slope(a, b)
    raise AssertionError("unreachable: n lies inside the curve")


def _interp(points: list[tuple[int, float]], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable: x lies inside the table")
