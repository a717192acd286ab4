"""Admission: the cost model and `decide` with fake timings, failures and overrides."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from melix_fsm.errors import MelixError
from melix_fsm.policy.cost_model import (
    FAMILY_PRIORS,
    GENERIC_PRIOR,
    Timings,
    acceptance_prior,
    acceptance_rate_of,
    expected_tokens,
    expected_tokens_from_positions,
    predicted_speedup,
)
from melix_fsm.policy.decision import Gate, HardwareDecision, Policy, Reason, decide
from melix_fsm.policy.errors import CalibrationError, PolicyError
from melix_fsm.policy.telemetry import Regime

from .conftest import BANDWIDTH_BOUND, COMPUTE_BOUND, PRIOR


def test_geometric_expected_tokens():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert acceptance_rate_of(0.5, 2) == pytest.approx(0.375)  # (0.5 + 0.25) / 2


def test_positions_match_counters_convention():
    # Counters.per_position_acceptance[p] = P(draft p accepted): E = 1 + sum.
    assert expected_tokens_from_positions([0.8, 0.64]) == pytest.approx(expected_tokens(0.8, 2))


def test_speedup_formula():
    t = Timings(t_1=2.0, t_verify=3.0, t_head=0.5, k=2)
    assert t.cycle_cost == pytest.approx(2.0)  # (3 + 2 * 0.5) / 2
    assert predicted_speedup(3.0, t) == pytest.approx(1.5)


def test_compute_bound_is_disabled():
    d = decide(COMPUTE_BOUND, "auto", PRIOR)
    assert d.hardware_gate is Gate.disabled and not d.speculate
    assert d.reason is Reason.compute_bound
    assert d.measured_regime is Regime.compute_bound
    assert d.predicted_speedup == pytest.approx(1.8 / 1.9)
    assert not d.operator_override and d.auto_gate is Gate.disabled


def test_bandwidth_bound_is_admitted():
    d = decide(BANDWIDTH_BOUND, Policy.auto, PRIOR)
    assert d.hardware_gate is Gate.admitted and d.speculate
    assert d.reason is Reason.bandwidth_bound
    assert d.predicted_speedup == pytest.approx(2.44 / 1.18)
    assert (d.t_1, d.t_verify, d.t_head, d.k, d.batch_size) == (1.0, 1.02, 0.08, 2, 1)


def test_intermediate_regime_reasons():
    # bf16-like: 1.3x for 2 tokens. A good head clears the margin, a poor one does not.
    t = Timings(t_1=1.0, t_verify=1.3, t_head=0.05, k=1)
    assert t.regime is Regime.intermediate
    good = decide(t, prior=FAMILY_PRIORS["deepseek_v3"])
    assert good.hardware_gate is Gate.admitted and good.reason is Reason.above_margin
    poor = decide(t, prior=msgspec.structs.replace(GENERIC_PRIOR, acceptance=0.3))
    assert poor.hardware_gate is Gate.disabled and poor.reason is Reason.below_margin


def test_margin_is_respected():
    # Speedup exactly 1.04: below a 5% margin, above a 3% one.
    t = Timings(t_1=1.0, t_verify=1.0, t_head=0.0, k=1)
    prior = msgspec.structs.replace(GENERIC_PRIOR, acceptance=0.04)
    assert decide(t, prior=prior, margin=0.05).hardware_gate is Gate.disabled
    assert decide(t, prior=prior, margin=0.03).hardware_gate is Gate.admitted


@pytest.mark.parametrize("reason", ["measurement_failed", "measurement_timeout", "measurement_poisoned"])
def test_failed_measurement_fails_closed(reason):
    d = decide(CalibrationError(reason, "boom"), "auto", PRIOR)
    assert d.hardware_gate is Gate.disabled and d.reason == reason and d.detail == "boom"
    assert d.predicted_speedup is None and d.t_1 is None


def test_unmeasured_is_not_evaluated_and_does_not_speculate():
    d = decide(None)
    assert d.hardware_gate is Gate.not_evaluated and d.reason is Reason.not_measured
    assert not d.speculate


def test_force_on_wins_over_terrible_timings_and_failures():
    for timings in (COMPUTE_BOUND, CalibrationError("measurement_timeout"), None):
        d = decide(timings, "force_on", PRIOR)
        assert d.hardware_gate is Gate.admitted and d.operator_override
        assert d.reason is Reason.operator_forced_on
    assert decide(COMPUTE_BOUND, "force_on", PRIOR).auto_gate is Gate.disabled


def test_force_off_wins_over_great_timings():
    d = decide(BANDWIDTH_BOUND, "force_off", PRIOR)
    assert d.hardware_gate is Gate.disabled and d.operator_override
    assert d.reason is Reason.operator_forced_off and d.auto_gate is Gate.admitted
    assert d.predicted_speedup is not None  # the figures are still recorded


_times = st.floats(min_value=1e-4, max_value=10.0, allow_nan=False)


@given(_times, _times, st.floats(0.0, 1.0), st.integers(1, 6), st.floats(0.0, 1.0))
def test_overrides_always_win(t_1, t_verify, t_head, k, acceptance):
    timings = Timings(t_1=t_1, t_verify=t_verify, t_head=t_head, k=k)
    prior = msgspec.structs.replace(GENERIC_PRIOR, acceptance=acceptance)
    assert decide(timings, "force_on", prior).hardware_gate is Gate.admitted
    assert decide(timings, "force_off", prior).hardware_gate is Gate.disabled
    auto = decide(timings, "auto", prior)
    assert auto.speculate == (auto.predicted_speedup >= 1.05)


def test_decision_round_trips_as_json():
    d = decide(BANDWIDTH_BOUND, "auto", PRIOR)
    raw = msgspec.json.encode(d)
    assert msgspec.json.decode(raw, type=HardwareDecision) == d
    assert b'"hardware_gate":"admitted"' in raw and b'"reason":"bandwidth_bound"' in raw


def test_bad_inputs_are_typed_errors():
    with pytest.raises(PolicyError):
        Timings(t_1=0.0, t_verify=1.0, t_head=0.1, k=1)
    with pytest.raises(PolicyError):
        Timings(t_1=1.0, t_verify=math.nan, t_head=0.1, k=1)
    with pytest.raises(PolicyError):
        Timings(t_1=1.0, t_verify=1.0, t_head=0.1, k=0)
    with pytest.raises(MelixError):
        decide("fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CalibrationError("because")


def test_family_priors():
    assert acceptance_prior("deepseek_v3").name == "deepseek_v3"
    assert acceptance_prior("unknown_family") is GENERIC_PRIOR
    assert acceptance_prior(None) is GENERIC_PRIOR
