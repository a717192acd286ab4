"""Device-aware activation: the cost model, the admission decision, the online controller.

Rules of this module:
- Pure and sans-IO: no mlx, no clock. Timings are inputs (melix_fsm.calibration measures
  them; the adapters build the timed forwards). Given the same inputs every function and
  the controller return the same outputs, bit for bit.
- Under mx.distributed the caller measures on rank 0 and broadcasts the `Timings` (and
  feeds every rank the same batch-level verify outcomes), so all ranks take one decision:
  a decision that differed between ranks would change verify shapes and deadlock the group.
- Cost model. Plain decode costs t_1 a token. A speculative cycle costs one verify over
  k+1 tokens plus k head drafts and emits E tokens, so
      predicted speedup = E / ((t_verify + k * t_head) / t_1),
  E = 1 + sum of per-position acceptances (exact for any acceptance pattern) or, from a
  per-draft acceptance a under the chained geometric model, E = sum_{i=0..k} a^i.
- Fail closed. Without timings `decide` says not_evaluated (no speculation under auto); a
  failed measurement says disabled with its typed reason. Only the operator's force_on /
  force_off overrides, and it is always recorded as such.
- The controller only ever returns keep / suspend / resume; the caller turns those into
  the lifecycle's suspend / resume events (at a cycle boundary) and keeps the returned
  `PolicyEvent` records for the receipt.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import msgspec

from .policy_errors import CalibrationError, PolicyError
from .telemetry import HardwarePrior, Regime


class Gate(enum.StrEnum):
    admitted = "admitted"
    disabled = "disabled"
    not_evaluated = "not_evaluated"


class Policy(enum.StrEnum):
    auto = "auto"
    force_on = "force_on"
    force_off = "force_off"


class Action(enum.StrEnum):
    keep = "keep"
    suspend = "suspend"
    resume = "resume"


class Reason(enum.StrEnum):
    """Why a decision came out as it did (the receipt's typed reason)."""

    # admission (decide)
    bandwidth_bound = "bandwidth_bound"  # admitted, and extra verify tokens are ~free
    above_margin = "above_margin"  # admitted, the speedup clears the margin anyway
    compute_bound = "compute_bound"  # refused/suspended: extra tokens cost ~their share
    below_margin = "below_margin"  # refused: not compute-bound, but no speedup to speak of
    not_measured = "not_measured"  # no timings yet (receipt resolved before loading)
    measurement_failed = "measurement_failed"
    measurement_timeout = "measurement_timeout"
    measurement_poisoned = "measurement_poisoned"
    operator_forced_on = "operator_forced_on"
    operator_forced_off = "operator_forced_off"
    # controller
    low_acceptance = "low_acceptance"  # suspended: the running acceptance no longer pays
    above_threshold = "above_threshold"  # resumed: the estimate pays again (e.g. batch shrank)
    probe = "probe"  # resumed for a short probe window to observe acceptance
    probe_passed = "probe_passed"  # the probe's acceptance pays: stay resumed
    probe_failed = "probe_failed"  # the probe's acceptance does not pay: suspend again


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


class HardwareDecision(msgspec.Struct, frozen=True, kw_only=True):
    """The hardware gate as the receipt records it."""

    hardware_gate: Gate
    hardware_policy: Policy
    operator_override: bool
    reason: Reason
    prior: AcceptancePrior
    margin: float
    auto_gate: Gate  # what auto alone would have decided (differs only under an override)
    t_1: float | None = None
    t_verify: float | None = None
    t_head: float | None = None
    batch_size: int | None = None
    k: int | None = None
    spread: float | None = None
    expected_tokens: float | None = None
    predicted_speedup: float | None = None
    measured_regime: Regime | None = None
    hardware: HardwarePrior | None = None
    detail: str = ""
    replay_rate: float | None = None  # replay forwards per cycle the cost model priced in
    cycle_cost: float | None = None  # every forward of one cycle, in units of t_1

    @property
    def speculate(self) -> bool:
        return self.hardware_gate is Gate.admitted


DEFAULT_MARGIN = 0.05


def decide(
    timings: Timings | CalibrationError | None,
    policy: Policy | str = Policy.auto,
    prior: AcceptancePrior = GENERIC_PRIOR,
    margin: float = DEFAULT_MARGIN,
    *,
    hardware: HardwarePrior | None = None,
    forwards: CycleForwards | None = None,
) -> HardwareDecision:
    """Admit speculation when measured timings predict a speedup of at least 1 + margin.

    timings: the measurement, the typed failure of one, or None (not measured yet).
    forwards: what one cycle runs (default: a verify and k head steps, no replay).
    The hardware prior is recorded, never used to admit: measurement decides.
    """
    policy = Policy(policy)
    fields: dict[str, object] = {}
    if isinstance(timings, Timings):
        forwards = forwards or CycleForwards()
        e = expected_tokens(prior.acceptance, timings.k)
        cost = timings.cost(forwards)
        speedup = e / cost
        regime = timings.regime
        fields = dict(
            t_1=timings.t_1,
            t_verify=timings.t_verify,
            t_head=timings.t_head,
            batch_size=timings.batch_size,
            k=timings.k,
            spread=timings.spread,
            expected_tokens=e,
            predicted_speedup=speedup,
            measured_regime=regime,
            replay_rate=forwards.replay,
            cycle_cost=cost,
        )
        if speedup >= 1.0 + margin:
            gate = Gate.admitted
            reason = Reason.bandwidth_bound if regime is Regime.bandwidth_bound else Reason.above_margin
        else:
            gate = Gate.disabled
            reason = Reason.compute_bound if regime is Regime.compute_bound else Reason.below_margin
    elif isinstance(timings, CalibrationError):
        gate, reason = Gate.disabled, Reason(timings.reason)
        fields["detail"] = timings.detail
    elif timings is None:
        gate, reason = Gate.not_evaluated, Reason.not_measured
    else:
        raise PolicyError(f"decide: expected Timings, CalibrationError or None, got {type(timings).__name__}")
    auto_gate = gate
    if policy is Policy.force_on:
        gate, reason = Gate.admitted, Reason.operator_forced_on
    elif policy is Policy.force_off:
        gate, reason = Gate.disabled, Reason.operator_forced_off
    return HardwareDecision(
        hardware_gate=gate,
        hardware_policy=policy,
        operator_override=policy is not Policy.auto,
        reason=reason,
        prior=prior,
        margin=margin,
        auto_gate=auto_gate,
        hardware=hardware,
        **fields,  # type: ignore[arg-type]
    )


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


# ---- the online controller ----------------------------------------------------------


class ControllerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Constants of the online controller (steps are controller `update` calls)."""

    alpha: float = 0.1  # EMA weight of one verify step (~10-step memory)
    every: int = 8  # re-evaluate the cost model every N steps
    suspend_below: float = 0.95  # suspend when the predicted speedup falls below this
    resume_above: float = 1.05  # resume (or pass a probe) only above this
    min_dwell: int = 32  # steps after any switch before the next policy switch
    probe_after: int = 64  # suspended steps before the first probe
    probe_steps: int = 8  # speculative steps in one probe window
    probe_backoff: float = 2.0  # the wait before the next probe grows by this per failure
    probe_max_after: int = 1024  # ... up to this many steps

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise PolicyError(f"controller: alpha must lie in (0, 1], got {self.alpha}")
        if not self.suspend_below < self.resume_above:
            raise PolicyError(
                "controller: suspend_below must be below resume_above (that gap is the hysteresis)"
            )
        if min(self.every, self.probe_steps, self.probe_after) < 1 or self.min_dwell < 0:
            raise PolicyError("controller: every, probe_steps and probe_after must be >= 1, min_dwell >= 0")
        if self.probe_backoff < 1.0 or self.probe_max_after < self.probe_after:
            raise PolicyError("controller: probe_backoff >= 1 and probe_max_after >= probe_after")


class PolicyEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded controller decision with the inputs it was taken from."""

    step: int
    action: Action
    reason: Reason
    batch_size: int
    ema_acceptance: float  # accepted / proposed, smoothed
    expected_tokens: float
    cycle_cost: float  # (t_verify + k t_head) / t_1 at this batch size
    predicted_speedup: float
    extrapolated: bool = False  # timings estimated beyond the calibrated batch sizes


class PolicyCounters(msgspec.Struct, kw_only=True):
    """Decision counters of one run (for the receipt)."""

    evaluations: int = 0
    suspend_decisions: int = 0  # policy suspensions (probe failures counted apart)
    resume_decisions: int = 0  # policy resumptions, passed probes included
    probes: int = 0
    probes_passed: int = 0
    probes_failed: int = 0
    steps_suspended: int = 0


class _Mode(enum.Enum):
    active = 1
    suspended = 2
    probing = 3


class ActivationController:
    """Keeps a speculating batch on only while the cost model says it pays.

    Call `update` once per decode step (a speculative cycle or a plain step) with the
    batch size and, for a cycle, the batch's summed verify outcome (accepted, proposed).
    The EMA tracks r = accepted / proposed; with every row proposing k drafts a cycle
    emits E = 1 + k r tokens per row, whatever the acceptance pattern, so the running
    estimate needs no geometric assumption. It starts at the prior's r.

    Hysteresis: suspend below `suspend_below`, resume above `resume_above`, and never two
    policy switches within `min_dwell` steps. While suspended nothing is observed, so the
    stale estimate cannot recover by itself: every `probe_after` steps (backing off after
    each failed probe) the controller resumes for `probe_steps` steps, replaces the stale
    estimate by what the probe saw, and keeps speculating only if that clears
    `resume_above`. A probe is skipped when even perfect acceptance could not pay at the
    current batch size. A suspension caused by cost alone (the batch grew) lifts without
    a probe once the estimate pays again at the current batch size.
    """

    def __init__(
        self,
        timings: TimingTable | Timings | None,
        *,
        prior: AcceptancePrior = GENERIC_PRIOR,
        policy: Policy | str = Policy.auto,
        config: ControllerConfig | None = None,
        active: bool = True,
    ) -> None:
        self.policy = Policy(policy)
        if isinstance(timings, Timings):
            timings = TimingTable.of(timings)
        if timings is None and self.policy is Policy.auto:
            raise PolicyError("controller: the auto policy needs measured timings")
        self.table = timings
        self.prior = prior
        self.config = config or ControllerConfig()
        self.k = timings.k if timings is not None else 1
        self.ema = acceptance_rate_of(prior.acceptance, self.k)
        self.step = 0
        self.events: list[PolicyEvent] = []
        self.counters = PolicyCounters()
        if self.policy is Policy.force_on:
            active = True
        elif self.policy is Policy.force_off:
            active = False
        self._mode = _Mode.active if active else _Mode.suspended
        self._last_switch = 0
        self._probe_wait = self.config.probe_after
        self._next_probe = self._probe_wait
        self._probe_done = 0
        self._probe_accepted = 0
        self._probe_proposed = 0

    # -- reading -------------------------------------------------------------------
    @property
    def speculating(self) -> bool:
        """Whether the next step should speculate (true during a probe)."""
        return self._mode is not _Mode.suspended

    @property
    def probing(self) -> bool:
        return self._mode is _Mode.probing

    def predict(self, batch_size: int, rate: float | None = None) -> tuple[float, float, float, bool]:
        """(expected tokens, cycle cost, predicted speedup, extrapolated) at batch_size."""
        if self.table is None:
            raise PolicyError("controller: no timings to predict from")
        t, extrapolated = self.table.at(batch_size)
        e = 1.0 + self.k * (self.ema if rate is None else rate)
        return e, t.cycle_cost, e / t.cycle_cost, extrapolated

    def summary(self) -> dict[str, object]:
        out = msgspec.structs.asdict(self.counters)
        out["ema_acceptance"] = self.ema
        out["speculating"] = self.speculating
        return out

    # -- writing -------------------------------------------------------------------
    def set_timings(self, timings: TimingTable | Timings) -> None:
        """Replace the timing table (a recalibration, broadcast from rank 0); same k."""
        if isinstance(timings, Timings):
            timings = TimingTable.of(timings)
        if self.table is not None and timings.k != self.k:
            raise PolicyError(f"controller: timings for k={timings.k}, controller runs k={self.k}")
        self.table = timings
        self.k = timings.k

    def update(self, batch_size: int, accepted: int = 0, proposed: int = 0) -> Action:
        """Feed one decode step; return what the caller must do before the next one."""
        if batch_size < 1 or not 0 <= accepted <= proposed:
            raise PolicyError(f"controller: bad step input B={batch_size}, {accepted}/{proposed}")
        self.step += 1
        if self.policy is not Policy.auto:
            if self._mode is _Mode.suspended:
                self.counters.steps_suspended += 1
            return Action.keep  # operator overrides always win: never switch
        mode = self._mode
        if mode is _Mode.suspended:
            self.counters.steps_suspended += 1
            return self._while_suspended(batch_size)
        if mode is _Mode.probing:
            return self._while_probing(batch_size, accepted, proposed)
        if proposed:
            self.ema += self.config.alpha * (accepted / proposed - self.ema)
        return self._while_active(batch_size)

    def _while_active(self, batch_size: int) -> Action:
        cfg = self.config
        if self.step % cfg.every:
            return Action.keep
        self.counters.evaluations += 1
        e, cost, speedup, extrapolated = self.predict(batch_size)
        if speedup >= cfg.suspend_below or self.step - self._last_switch < cfg.min_dwell:
            return Action.keep
        # Would perfect acceptance pay at this batch size? If not, cost is the culprit.
        reason = Reason.compute_bound if (self.k + 1) / cost < cfg.resume_above else Reason.low_acceptance
        self._switch(_Mode.suspended)
        self._next_probe = self.step + self._probe_wait
        self.counters.suspend_decisions += 1
        return self._record(Action.suspend, reason, batch_size, e, cost, speedup, extrapolated)

    def _while_suspended(self, batch_size: int) -> Action:
        cfg = self.config
        if self.step % cfg.every or self.step - self._last_switch < cfg.min_dwell:
            return Action.keep
        self.counters.evaluations += 1
        e, cost, speedup, extrapolated = self.predict(batch_size)
        if speedup > cfg.resume_above:
            self._switch(_Mode.active)
            self.counters.resume_decisions += 1
            return self._record(
                Action.resume, Reason.above_threshold, batch_size, e, cost, speedup, extrapolated
            )
        if self.step < self._next_probe:
            return Action.keep
        if (self.k + 1) / cost <= cfg.resume_above:
            self._next_probe = self.step + self._probe_wait  # no acceptance could pay: don't probe
            return Action.keep
        self._mode = _Mode.probing  # not a policy switch: the dwell clock keeps running
        self._probe_done = self._probe_accepted = self._probe_proposed = 0
        self.counters.probes += 1
        return self._record(Action.resume, Reason.probe, batch_size, e, cost, speedup, extrapolated)

    def _while_probing(self, batch_size: int, accepted: int, proposed: int) -> Action:
        cfg = self.config
        self._probe_done += 1
        self._probe_accepted += accepted
        self._probe_proposed += proposed
        if self._probe_done < cfg.probe_steps:
            return Action.keep
        if self._probe_proposed:
            # The stale estimate is what suspended the batch; the probe is the evidence.
            self.ema = self._probe_accepted / self._probe_proposed
        self.counters.evaluations += 1
        e, cost, speedup, extrapolated = self.predict(batch_size)
        if speedup > cfg.resume_above:
            self._switch(_Mode.active)
            self._probe_wait = cfg.probe_after
            self.counters.probes_passed += 1
            self.counters.resume_decisions += 1
            return self._record(Action.keep, Reason.probe_passed, batch_size, e, cost, speedup, extrapolated)
        self._mode = _Mode.suspended
        self._probe_wait = min(cfg.probe_max_after, math.ceil(self._probe_wait * cfg.probe_backoff))
        self._next_probe = self.step + self._probe_wait
        self.counters.probes_failed += 1
        return self._record(Action.suspend, Reason.probe_failed, batch_size, e, cost, speedup, extrapolated)

    def _switch(self, mode: _Mode) -> None:
        self._mode = mode
        self._last_switch = self.step

    def _record(
        self,
        action: Action,
        reason: Reason,
        batch_size: int,
        e: float,
        cost: float,
        speedup: float,
        extrapolated: bool,
    ) -> Action:
        self.events.append(
            PolicyEvent(
                step=self.step,
                action=action,
                reason=reason,
                batch_size=batch_size,
                ema_acceptance=self.ema,
                expected_tokens=e,
                cycle_cost=cost,
                predicted_speedup=speedup,
                extrapolated=extrapolated,
            )
        )
        return action
