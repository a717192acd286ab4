"""The divergence contract: tell a rounding-level near-tie from a bug at the first divergent token.

Rules of this module:
- Where a generator's greedy tokens first differ from the reference's, the judge asks the
  reference model for its logits z at that position (`logits_of(prompt + the reference's
  tokens before it)`) and measures: `margin` = z[top] - z[runner-up] (the reference's own
  top-two margin) and `gap` = |z[reference token] - z[generated token]| (how far the
  generator's pick was from the reference's: never less than the margin when the
  reference's token is the top one).
- The rounding scale is `eps(dtype) * max_v |z_v|`: one unit in the last place of the
  largest logit in the dtype the logits are computed in (eps: float32 2^-23, float16
  2^-10, bfloat16 2^-7; quantized weights compute in their activation dtype). The
  contract bound is `ulps` such units (default `DEFAULT_ULPS` = 8). Why 8: a kernel that
  splits a sum differently (a multi-row verify against a one-row decode) ends each layer
  with outputs one rounding apart at most, every stored activation is rounded to the
  dtype again, and the norms and residual adds that follow carry those differences to
  the logits at the same relative scale; the final projection rounds once more. A few
  ulps of the largest logit is that scale; 8 leaves headroom for depth without
  reaching the gaps planted bugs produce (a token from the wrong context is off by the
  model's own spread of logits, orders of magnitude more in every regime measured,
  docs/conformance.md).
- A divergence with `gap <= ulps * scale` is a **near-tie** (both tokens were within
  rounding of each other: the platform's arithmetic may pick either); anything else is
  a **bug**. The judge classifies the first divergent position of a stream only: after
  it the stream continues from another context, so its later tokens are not compared
  (the driver stops checking that request; a bug that first shows at a near-tie is
  caught by the next request it touches).
- The contract applies where arithmetic rounds differently; it never loosens a regime
  that is bit-exact: without a judge the driver treats every divergence as a bug
  (`exact`), which is what the identity tests use.
- A `DivergenceLedger` counts the tokens compared and every divergence judged, and
  reports the rate per 1,000 tokens and a histogram of the gaps in units of the
  rounding scale (`BINS`). `DivergenceJudge.silent()` shares the judge without the
  ledger (replays that shrink a bug must not count it again).
- Pure core: no mlx; `logits_of` is the adapter's (melix_mlx.tools.qa.margins).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

LogitsOf = Callable[[tuple[int, ...]], Sequence[float]]

EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
DEFAULT_ULPS = 8.0
CACHE_CONTEXTS = 64  # logit rows a judge keeps (a replay meets the same divergences again)
NEAR_TIE, BUG = "near_tie", "bug"
# histogram bins of gap / scale (ulps of the largest logit): the first four are near-ties
# at the default bound, the rest bugs
BINS = (1.0, 2.0, 4.0, 8.0, 64.0, 1024.0, math.inf)


@dataclass(frozen=True)
class RoundingContract:
    """The bound of a near-tie: `ulps` units of the largest logit's last place in `dtype`."""

    dtype: str
    ulps: float = DEFAULT_ULPS

    def __post_init__(self) -> None:
        if self.dtype not in EPS:
            raise ValueError(f"unknown logits dtype {self.dtype!r}; choose one of {sorted(EPS)}")
        if not self.ulps > 0:
            raise ValueError(f"the near-tie bound must be > 0 ulps, got {self.ulps}")

    @property
    def eps(self) -> float:
        return EPS[self.dtype]

    def scale(self, magnitude: float) -> float:
        """One unit in the last place of a logit of this magnitude (never zero)."""
        return self.eps * max(abs(magnitude), 1e-30)

    def describe(self) -> str:
        return (
            f"near-tie iff |z[ref] - z[got]| <= {self.ulps:g} x eps({self.dtype}) x max|z| "
            f"(eps = 2^{int(math.log2(self.eps))})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "eps": self.eps, "ulps": self.ulps, "rule": self.describe()}


@dataclass(frozen=True)
class Divergence:
    """The first divergent position of one stream, measured on the reference's logits."""

    request: int
    position: int
    reference_token: int
    got_token: int
    margin: float  # z[top] - z[runner-up] of the reference
    gap: float  # |z[reference token] - z[got token]|
    magnitude: float  # max |z|
    scale: float  # eps(dtype) * magnitude
    kind: str  # NEAR_TIE or BUG
    where: str = ""

    @property
    def ulps(self) -> float:
        return self.gap / self.scale

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gap_ulps"] = self.ulps
        return out

    def text(self) -> str:
        what = "near-tie" if self.kind == NEAR_TIE else "bug"
        return (
            f"position {self.position}: reference {self.reference_token}, got {self.got_token}; "
            f"gap {self.gap:.4g} = {self.ulps:.3g} ulps of max|z| {self.magnitude:.4g} "
            f"(reference top-2 margin {self.margin:.4g}): {what}"
        )


@dataclass
class DivergenceLedger:
    """Tokens compared and divergences judged over a run; rates and a margin histogram."""

    contract: RoundingContract
    tokens: int = 0
    divergences: list[Divergence] = field(default_factory=list)

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def record(self, divergence: Divergence) -> None:
        self.divergences.append(divergence)

    def count(self, kind: str) -> int:
        return sum(d.kind == kind for d in self.divergences)

    def per_1000(self, kind: str | None = None) -> float:
        n = len(self.divergences) if kind is None else self.count(kind)
        return 1000.0 * n / self.tokens if self.tokens else 0.0

    def histogram(self) -> list[dict[str, Any]]:
        """Divergences per bin of gap / scale, in ulps of the largest logit."""
        bins = []
        low = 0.0
        for high in BINS:
            n = sum(low <= d.ulps and (d.ulps < high or math.isinf(high)) for d in self.divergences)
            label = f"{low:g}-{high:g}" if math.isfinite(high) else f">={low:g}"
            bins.append({"ulps": label, "count": n})
            low = high
        return bins

    def as_dict(self) -> dict[str, Any]:
        return {
            "contract": self.contract.as_dict(),
            "tokens_compared": self.tokens,
            "divergences": len(self.divergences),
            "near_ties": self.count(NEAR_TIE),
            "bugs": self.count(BUG),
            "per_1000_tokens": {
                "all": self.per_1000(),
                "near_tie": self.per_1000(NEAR_TIE),
                "bug": self.per_1000(BUG),
            },
            "histogram": self.histogram(),
            "records": [d.as_dict() for d in self.divergences[:50]],
        }

    def text_lines(self, title: str = "divergence") -> list[str]:
        c = self.contract
        head = (
            f"{title}: {len(self.divergences)} in {self.tokens} tokens compared "
            f"({self.per_1000():.3g} per 1,000): {self.count(NEAR_TIE)} near-tie(s), "
            f"{self.count(BUG)} bug(s); contract: {c.describe()}"
        )
        if not self.divergences:
            return [head + "; bit-exact"]
        bars = ", ".join(f"{b['ulps']}: {b['count']}" for b in self.histogram() if b["count"])
        return [head, f"  gaps in ulps of max|z|: {bars}"]


class DivergenceJudge:
    """Classifies a stream's first divergent token by the reference's logits (module rules)."""

    def __init__(
        self, logits_of: LogitsOf, contract: RoundingContract, ledger: DivergenceLedger | None = None
    ) -> None:
        self.logits_of = logits_of
        self.contract = contract
        self.ledger = ledger
        self._cache: dict[tuple[int, ...], tuple[float, float, float, Sequence[float]]] = {}

    def silent(self) -> DivergenceJudge:
        """The same judge (and logits cache), recording nothing."""
        twin = DivergenceJudge(self.logits_of, self.contract, None)
        twin._cache = self._cache
        return twin

    def count_tokens(self, n: int) -> None:
        if self.ledger is not None:
            self.ledger.add_tokens(n)

    def _logits(self, context: tuple[int, ...]) -> tuple[float, float, float, Sequence[float]]:
        if context not in self._cache:
            if len(self._cache) >= CACHE_CONTEXTS:  # whole logit rows: keep memory bounded
                self._cache.clear()
            z = [float(v) for v in self.logits_of(context)]
            if len(z) < 2:
                raise ValueError(f"logits_of returned {len(z)} logits; the contract needs the whole row")
            top, second = sorted(z)[-2:][::-1]
            self._cache[context] = (top, second, max(abs(v) for v in z), z)
        return self._cache[context]

    def judge(
        self,
        prompt: Sequence[int],
        before: Sequence[int],
        reference_token: int,
        got_token: int,
        *,
        request: int = -1,
        where: str = "",
    ) -> Divergence:
        """Measure and classify one divergence (`before`: the reference's tokens before it)."""
        top, second, magnitude, z = self._logits(tuple(prompt) + tuple(before))
        scale = self.contract.scale(magnitude)
        if not 0 <= got_token < len(z) or not 0 <= reference_token < len(z):
            gap = math.inf  # a token outside the vocabulary is never a rounding matter
        else:
            gap = abs(z[reference_token] - z[got_token])
        kind = NEAR_TIE if gap <= self.contract.ulps * scale else BUG
        found = Divergence(
            request, len(before), reference_token, got_token, top - second, gap, magnitude, scale, kind, where
        )
        if self.ledger is not None:
            self.ledger.record(found)
        return found


def judge_for(logits_of: LogitsOf, dtype: str, ulps: float = DEFAULT_ULPS) -> DivergenceJudge:
    """A judge with a fresh ledger for logits computed in `dtype`."""
    contract = RoundingContract(dtype, ulps)
    return DivergenceJudge(logits_of, contract, DivergenceLedger(contract))


__all__ = [
    "BINS",
    "BUG",
    "DEFAULT_ULPS",
    "EPS",
    "NEAR_TIE",
    "Divergence",
    "DivergenceJudge",
    "DivergenceLedger",
    "LogitsOf",
    "RoundingContract",
    "judge_for",
]
