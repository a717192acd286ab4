"""`measure` with a fake clock: medians, warm-up, and every typed refusal."""

from __future__ import annotations

import pytest

from melix_fsm.errors import MelixError
from melix_fsm.policy.calibration import measure, measure_table, out_of_order, relative_mad, try_measure
from melix_fsm.policy.cost_model import Timings
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


# -- across batch sizes: out_of_order and measure_table -------------------------------


def _at(batch_size: int, t_1: float, t_verify: float | None = None) -> Timings:
    return Timings(t_1=t_1, t_verify=t_verify or 1.3 * t_1, t_head=0.07 * t_1, k=1, batch_size=batch_size)


class Scripted:
    """`measure_at` returning, per batch size, the next scripted result (a Timings or a
    CalibrationError to raise); records every call."""

    def __init__(self, script: dict[int, list[Timings | CalibrationError]]) -> None:
        self.script = {b: list(results) for b, results in script.items()}
        self.calls: list[int] = []

    def __call__(self, batch_size: int) -> Timings:
        self.calls.append(batch_size)
        result = self.script[batch_size].pop(0)
        if isinstance(result, CalibrationError):
            raise result
        return result


def test_a_smaller_batch_much_slower_than_a_larger_one_is_out_of_order():
    # the field case: t_1 at B=4 32.5 ms against 23.3 ms at B=8 (verify in order)
    entries = [_at(1, 10.6), _at(2, 15.4), _at(4, 32.5, 33.6), _at(8, 23.3, 36.4)]
    clashes = out_of_order(entries)
    assert [(c.smaller.batch_size, c.larger.batch_size, c.figure) for c in clashes] == [(4, 8, "t_1")]
    assert "t_1 at B=4" in str(clashes[0]) and "B=8" in str(clashes[0])
    # within the tolerance (noise between near-equal sizes) is not a clash
    assert out_of_order([_at(1, 12.8), _at(2, 12.6), _at(3, 14.2)]) == []
    assert out_of_order([_at(2, 12.0), _at(4, 10.0)], tolerance=0.25) == []
    assert len(out_of_order([_at(2, 12.0), _at(4, 10.0)], tolerance=0.1)) == 2  # t_1 and t_verify


def test_measure_table_measures_a_clash_again_and_keeps_the_consistent_figures():
    measure_at = Scripted(
        {1: [_at(1, 10.6)], 4: [_at(4, 32.5), _at(4, 17.0)], 8: [_at(8, 23.3), _at(8, 22.0)]}
    )
    table = measure_table(measure_at, [1, 4, 8])
    assert measure_at.calls == [1, 4, 8, 4, 8]  # both sides of the clash, once
    assert [t.t_1 for t in table.entries] == [10.6, 17.0, 22.0]
    assert table.entries[0].remeasured == ""
    assert "t_1 at B=4" in table.entries[1].remeasured and table.entries[2].remeasured
    d = decide(table.entries[1], prior=PRIOR)
    assert d.detail.startswith("re-measured: t_1 at B=4")  # the receipt says what happened


def test_measure_table_refuses_a_clash_that_stays():
    measure_at = Scripted({1: [_at(1, 30.0), _at(1, 31.0)], 2: [_at(2, 12.0), _at(2, 12.5)]})
    with pytest.raises(CalibrationError) as info:
        measure_table(measure_at, [1, 2])
    assert info.value.reason == "measurement_poisoned" and "t_1 at B=1" in info.value.detail
    assert measure_at.calls == [1, 2, 1, 2]


def test_measure_table_retries_poisoned_samples_once():
    poisoned = CalibrationError("measurement_poisoned", "t_1 samples spread 33% (limit 25%)")
    measure_at = Scripted({1: [poisoned, _at(1, 10.0)], 2: [_at(2, 12.0)]})
    table = measure_table(measure_at, [1, 2])
    assert measure_at.calls == [1, 1, 2] and table.entries[0].remeasured.startswith("t_1 samples spread")
    twice = Scripted({1: [poisoned, poisoned]})
    with pytest.raises(CalibrationError) as info:
        measure_table(twice, [1])
    assert info.value.reason == "measurement_poisoned" and twice.calls == [1, 1]


def test_measure_table_without_retry_and_other_failures_raise_at_once():
    poisoned = CalibrationError("measurement_poisoned", "spread")
    for retry, script, reason in [
        (False, {1: [poisoned]}, "measurement_poisoned"),  # a group of ranks: no second run
        (True, {1: [CalibrationError("measurement_timeout", "budget")]}, "measurement_timeout"),
        (True, {1: [CalibrationError("measurement_failed", "oom")]}, "measurement_failed"),
    ]:
        measure_at = Scripted(script)
        with pytest.raises(CalibrationError) as info:
            measure_table(measure_at, [1], retry=retry)
        assert info.value.reason == reason and measure_at.calls == [1]
    clash = Scripted({1: [_at(1, 30.0)], 2: [_at(2, 12.0)]})
    with pytest.raises(CalibrationError):
        measure_table(clash, [1, 2], retry=False)
    assert clash.calls == [1, 2]
