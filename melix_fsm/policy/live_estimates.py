"""What the live controller measures and predicts: samples, rates, the calibrated prior's
prices and the speedup estimates its verdicts compare (melix_fsm.policy.controller holds
the controller, its mode machine and its schedule; this module holds the arithmetic).

Rules of this module:
- `LiveEstimates` is the controller's measuring half, a base class over the controller's
  own state (the attributes annotated below, set by `LiveController.__init__`): it reads
  and records samples and prices cycles, and never changes the controller's mode.
- Samples are comparable across batch sizes: each step's tokens are weighted by
  t_1(B) / B from the calibration (1 / B without one), so a plain step that runs exactly
  as calibrated scores 1.0 and a speculative one scores its speedup. B is the batch whose
  plain step the tokens replace: the step's own, or the size a draining batch started
  from (`LiveController.update`'s `priced_at`).
- "Clearly" below or above a threshold means: even z standard errors the other way, the
  estimate stays on its side (`_below`, `_above`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .cost_model import AcceptancePrior, CycleForwards, Timings, TimingTable
from .depth import DepthChooser, model_choice
from .errors import PolicyError
from .live_types import Estimate, LiveConfig, LiveCounters
from .throughput import PositionAcceptance, Rate


class LiveEstimates:
    """Measurements and the prior of a live controller (see the module rules)."""

    config: LiveConfig
    prior: AcceptancePrior
    replay_on_reject: bool
    table: TimingTable | None
    acceptance: PositionAcceptance
    ema: float
    plain: Rate
    depth: DepthChooser
    counters: LiveCounters
    _priced: dict[tuple[int, int], Timings]
    _timed: bool

    def cycle_cost(self, batch_size: int, k: int) -> float:
        """The calibrated cost of one cycle at depth k, every forward counted (units of t_1)."""
        if self.table is None:
            raise PolicyError("live controller: no timings to price a cycle with")
        timings = self._timings_at(batch_size, k)
        replay = 0.0
        if self.replay_on_reject:  # one rejecting row replays the whole batch
            replay = 1.0 - self.acceptance.position(k) ** batch_size
        return timings.cost(CycleForwards(replay=replay))

    def estimate(self, batch_size: int, k: int | None = None) -> Estimate:
        """Speedup of depth k over plain at batch_size: measured where both sides are."""
        k = self.depth.chosen if k is None else k
        min_n = self.config.min_samples
        plain = self.plain.value if self.plain.n >= min_n else None
        rate = self.depth.rates[k]
        spec = rate.value if rate.n >= min_n else None
        predicted = self._predicted(batch_size, k)
        noise = _combined(rate.relative_noise, self.plain.relative_noise if plain is not None else 0.0)
        if spec is not None and plain is not None:
            return Estimate(
                noise=noise,
                speedup=spec / plain,
                source="measured",
                spec_rate=spec,
                plain_rate=plain,
                predicted=predicted,
            )
        if spec is not None and self.table is not None:  # against the calibrated plain (1.0)
            return Estimate(
                noise=noise,
                speedup=spec,
                source="measured_spec",
                spec_rate=spec,
                plain_rate=plain,
                predicted=predicted,
            )
        source = "model" if predicted is not None else "none"
        return Estimate(
            speedup=predicted, source=source, spec_rate=spec, plain_rate=plain, predicted=predicted
        )

    def set_timings(self, timings: TimingTable | Timings) -> None:
        """Replace the prior (a recalibration, broadcast from rank 0)."""
        self.table = TimingTable.of(timings) if isinstance(timings, Timings) else timings
        self._priced.clear()

    @staticmethod
    def _check(
        batch_size: int,
        accepted: int,
        proposed: int,
        seconds: float | None,
        tokens: int | None,
        per_position: Sequence[int] | None,
    ) -> None:
        if batch_size < 1 or not 0 <= accepted <= proposed:
            raise PolicyError(f"live controller: bad step input B={batch_size}, {accepted}/{proposed}")
        if seconds is not None and not (math.isfinite(seconds) and seconds >= 0.0):
            raise PolicyError(f"live controller: seconds must be a finite time >= 0, got {seconds!r}")
        if tokens is not None and tokens < 0:
            raise PolicyError(f"live controller: tokens must be >= 0, got {tokens}")
        if per_position is not None and (any(c < 0 for c in per_position) or sum(per_position) != accepted):
            raise PolicyError("live controller: accepted_per_position must be counts summing to accepted")

    def _weight(self, batch_size: int) -> float:
        """Tokens -> plain-step equivalents: t_1(B) / B, so calibrated plain scores 1."""
        if self.table is None:
            return 1.0 / batch_size
        return self._timings_at(batch_size, self.table.k).t_1 / batch_size

    def _timings_at(self, batch_size: int, k: int) -> Timings:
        key = (batch_size, k)
        timings = self._priced.get(key)
        if timings is None:
            assert self.table is not None
            timings = self._priced[key] = self.table.at(batch_size, k)[0]
        return timings

    def _observe(
        self,
        batch_size: int,
        accepted: int,
        proposed: int,
        seconds: float | None,
        tokens: int | None,
        per_position: Sequence[int] | None,
        exclude: bool,
        k_before: int,
        priced_at: int,
    ) -> tuple[bool, bool]:
        """Record acceptance and timing; (whether the step drafted, whether its timing counted).
        Its tokens are priced at batch `priced_at`'s calibrated plain step (`_weight`)."""
        c = self.counters
        c.steps += 1
        drafted = proposed > 0
        if per_position is not None:
            k_step = len(per_position)
        else:  # proposed = drafting rows x k; a shorter (truncated) cycle is no sample of k
            k_step = k_before if proposed % k_before == 0 else max(1, proposed // batch_size)
        if drafted:
            c.steps_speculative += 1
            rows = max(1, proposed // max(1, k_step))
            if per_position is not None:
                self.acceptance.observe(per_position, rows)
            else:
                self.acceptance.observe_rate(accepted, proposed, k_step, rows)
            self.ema += self.config.alpha * (accepted / proposed - self.ema)
        else:
            c.steps_plain += 1
        if exclude:
            c.steps_excluded += 1
            return drafted, False
        if seconds is None:
            c.steps_untimed += 1
            return drafted, False
        if seconds <= 0.0:
            return drafted, False
        emitted = accepted + batch_size if tokens is None else tokens
        weighted = emitted * self._weight(priced_at)
        if not drafted:
            self.plain.add(weighted, seconds)
        elif k_step == k_before:  # a truncated cycle (fewer drafts than asked) is not a sample of k
            self.depth.observe(k_step, weighted, seconds)
        else:
            return drafted, False
        self._timed = True
        return drafted, True

    def _priced_right(self, est: Estimate) -> bool:
        """The calibration prices the live cycles: they run at most `defer_priced_within`
        faster than it says (measured over predicted speedup, both against the calibrated
        plain, is the calibrated cycle's time over the live one's). A calibration taken in
        a slow window prices the cycle and the plain step alike too slow, so speculation
        then measures ahead of a calibrated plain step the live one outruns."""
        if est.speedup is None or est.predicted is None:
            return False
        return est.speedup <= est.predicted * self.config.defer_priced_within

    def _calibrated_at(self, batch_size: int) -> bool:
        """The calibrated plain is a measurement only at a calibrated batch size."""
        return any(t.batch_size == batch_size for t in self.table.entries) if self.table else False

    def _below(self, est: Estimate, threshold: float) -> bool:
        """Clearly below: even z standard errors up, the speedup stays under the threshold."""
        return est.speedup is not None and est.speedup * (1.0 + self.config.z * est.noise) < threshold

    def _above(self, est: Estimate, threshold: float) -> bool:
        return est.speedup is not None and est.speedup * (1.0 - self.config.z * est.noise) > threshold

    def _perfect_speedup(self, batch_size: int) -> float:
        """The calibrated speedup if every draft were kept (no replay): the best case."""
        k = self.depth.chosen
        return (k + 1) / self._timings_at(batch_size, k).cost(CycleForwards())

    def _cost_fn(self, batch_size: int) -> Callable[[int], float] | None:
        if self.table is None:
            return None
        return lambda k: self.cycle_cost(batch_size, k)

    def _predicted(self, batch_size: int, k: int) -> float | None:
        if self.table is None:
            return None
        return self.acceptance.expected_tokens(k) / self.cycle_cost(batch_size, k)

    def _prior_depth(self, batch_size: int, max_k: int) -> int:
        """auto depth's first k: the cost model's best under the acceptance prior (1 without one)."""
        cost = self._cost_fn(batch_size)
        if cost is None:
            return 1
        return model_choice(self.acceptance, cost, max_k, self.config.depth.tie)


def _combined(*relative_errors: float) -> float:
    """Relative standard error of a ratio of independent estimates (inf while unknown)."""
    return math.sqrt(sum(e * e for e in relative_errors))
