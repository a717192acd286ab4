"""The admission decision: does the measured device make speculation pay here?

Rules of this module:
- Pure and sans-IO. `decide` turns timings (or the typed failure of measuring them) and
  an acceptance prior into the hardware gate the receipt records.
- Fail closed. Without timings `decide` says not_evaluated (no speculation under auto); a
  failed measurement says disabled with its typed reason. Only the operator's force_on /
  force_off overrides, and it is always recorded as such.
- Under mx.distributed the caller measures on rank 0 and broadcasts the `Timings`, so
  all ranks take one decision: one that differed would change verify shapes and deadlock.
"""

from __future__ import annotations

import enum

import msgspec

from ..config import DevicePolicy
from .cost_model import GENERIC_PRIOR, AcceptancePrior, CycleForwards, Timings, expected_tokens
from .errors import CalibrationError, PolicyError
from .telemetry import HardwarePrior, Regime


class HardwareGate(enum.StrEnum):
    """The receipt's hardware gate: what the measured device policy said of this start."""

    admitted = "admitted"
    disabled = "disabled"
    not_evaluated = "not_evaluated"


# One enum each, under the names both layers used: the operator's policy is the config's
# (melix_fsm.config.DevicePolicy), the gate is the one above (the receipt's field type).
Gate = HardwareGate
Policy = DevicePolicy


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
        if timings.remeasured:
            fields["detail"] = f"re-measured: {timings.remeasured}"
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


