"""`measure` with a fake clock: medians, warm-up, and every typed refusal."""

from __future__ import annotations

import pytest

from melix_fsm.errors import MelixError
from melix_fsm.policy.calibration import measure, relative_mad, try_measure
from melix_fsm.policy.decision import Gate, Reason, decide
from melix_fsm.policy.errors import CalibrationError, PolicyError

from .conftest import PRIOR, FakeClock


def test_medians_with_warmup_discarded(clock: FakeClock):
    # Warm-up calls are slow (compilation, cold caches); then one stray sample per forward.
    fn_1 = clock.forward(9.0, 9.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 1.0)
    fn_v = clock.forward(9.0, 9.0, 1.8, 1.8, 1.8, 1.8, 1.8, 1.8, 1.9)
    fn_h = clock.forward(9.0, 9.0, 0.1)
    t = measure(fn_1, fn_v, fn_h, k=1, batch_size=2, timer=clock, budget_s=1e6)
    assert (t.t_1, t.t_verify, t.t_head) == pytest.approx((1.0, 1.8, 0.1))
    assert (t.k, t.batch_size, t.runs) == (1, 2, 7)
    assert t.spread == pytest.approx(0.0, abs=1e-9)  # the MAD ignores the strays
    assert decide(t, prior=PRIOR).reason is Reason.compute_bound


def test_forwards_are_interleaved(clock: FakeClock):
    order: list[str] = []
    fns = [lambda n=n: (order.append(n), setattr(clock, "now", clock.now + 1)) for n in "1vh"]
    measure(*fns, k=1, runs=2, warmup=1, timer=clock)
    assert "".join(order) == "1vh" * 3


def test_exception_is_measurement_failed(clock: FakeClock):
    def broken() -> None:
        raise RuntimeError("metal: out of memory")

    with pytest.raises(CalibrationError) as info:
        measure(clock.forward(1.0), broken, clock.forward(0.1), k=2, timer=clock)
    assert info.value.reason == "measurement_failed" and "out of memory" in info.value.detail
    assert isinstance(info.value, MelixError) and isinstance(info.value.__cause__, RuntimeError)


def test_budget_is_measurement_timeout(clock: FakeClock):
    with pytest.raises(CalibrationError) as info:
        measure(clock.forward(1.0), clock.forward(30.0), clock.forward(0.1), k=2, timer=clock, budget_s=60)
    assert info.value.reason == "measurement_timeout"


def test_clock_that_does_not_advance_is_measurement_failed(clock: FakeClock):
    with pytest.raises(CalibrationError) as info:
        measure(clock.forward(1.0), clock.forward(0.0), clock.forward(0.1), k=2, timer=clock)
    assert info.value.reason == "measurement_failed"


def test_poisoned_samples_are_refused(clock: FakeClock):
    # A prefill competing throughout: every verify sample is slowed by a different amount.
    fn_v = clock.forward(1.0, 2.5, 1.3, 3.1, 1.8, 2.2, 1.1)
    with pytest.raises(CalibrationError) as info:
        measure(clock.forward(1.0), fn_v, clock.forward(0.1), k=2, timer=clock, warmup=0)
    assert info.value.reason == "measurement_poisoned" and "t_verify" in info.value.detail


def test_a_minority_of_strays_leaves_the_median_intact(clock: FakeClock):
    fn_v = clock.forward(1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.0)
    t = measure(clock.forward(1.0), fn_v, clock.forward(0.1), k=2, timer=clock, warmup=0)
    assert t.t_verify == pytest.approx(1.0)


def test_try_measure_feeds_decide_a_typed_refusal(clock: FakeClock):
    result = try_measure(
        clock.forward(1.0), clock.forward(30.0), clock.forward(0.1), k=2, timer=clock, budget_s=1
    )
    assert isinstance(result, CalibrationError)
    d = decide(result, prior=PRIOR)
    assert d.hardware_gate is Gate.disabled and d.reason is Reason.measurement_timeout


def test_bad_arguments(clock: FakeClock):
    with pytest.raises(PolicyError):
        measure(clock.forward(1.0), clock.forward(1.0), clock.forward(1.0), k=0, timer=clock)
    with pytest.raises(PolicyError):
        measure(clock.forward(1.0), clock.forward(1.0), clock.forward(1.0), k=1, runs=0, timer=clock)


def test_relative_mad():
    assert relative_mad([1.0, 1.0, 1.0, 100.0]) == 0.0
    assert relative_mad([1.0, 2.0, 3.0]) == pytest.approx(0.5)
