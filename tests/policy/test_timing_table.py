"""Timings across batch sizes: exact where calibrated, roofline in between, pessimistic beyond."""

from __future__ import annotations

import pytest

from melix_fsm.policy.cost_model import Timings, TimingTable
from melix_fsm.policy.errors import PolicyError

from .conftest import BANDWIDTH_BOUND

B1 = Timings(t_1=1.0, t_verify=1.0, t_head=0.1, k=2, batch_size=1)
B4 = Timings(t_1=1.2, t_verify=2.4, t_head=0.15, k=2, batch_size=4)
TABLE = TimingTable.of(B4, B1)


def test_calibrated_sizes_are_returned_as_measured():
    assert TABLE.at(1) == (B1, False)
    assert TABLE.at(4) == (B4, False)
    assert TABLE.k == 2


def test_interpolation_is_monotone_and_bounded():
    t2, extrapolated = TABLE.at(2)
    assert not extrapolated and t2.note == "interpolated" and t2.batch_size == 2
    # curve points: n=1 -> 1.0, n=3 -> 1.0, n=4 -> 1.2, n=12 -> 2.4; t_1(2) = f(2), t_verify(2) = f(6)
    assert t2.t_1 == pytest.approx(1.0)
    assert 1.2 < t2.t_verify < 2.4
    costs = [TABLE.at(b)[0].cycle_cost for b in (1, 2, 3, 4)]
    assert costs == sorted(costs)
    assert B1.t_head / B1.t_1 < t2.t_head / t2.t_1 < B4.t_head / B4.t_1


def test_beyond_the_table_errs_towards_suspending():
    t16, extrapolated = TABLE.at(16)
    assert extrapolated and t16.note == "extrapolated"
    assert t16.cycle_cost >= B4.cycle_cost
    assert t16.t_verify == pytest.approx(2.4 * 48 / 12)  # slope 1 beyond the last point


def test_single_bandwidth_bound_entry_extrapolates_pessimistically():
    table = TimingTable.of(BANDWIDTH_BOUND)
    t2, extrapolated = table.at(2)
    assert extrapolated
    assert t2.t_1 == pytest.approx(1.02 * (2 / 3) ** 0.0181, rel=0.05)
    assert t2.t_verify == pytest.approx(1.02 * 2)
    relaxed = TimingTable.of(BANDWIDTH_BOUND, beyond_slope=0.0).at(2)[0]
    assert relaxed.cycle_cost < t2.cycle_cost


def test_below_the_table_keeps_the_first_slope():
    t1, extrapolated = TimingTable.of(B4).at(1)
    assert extrapolated
    # slope between n=4 (1.2) and n=12 (2.4) is log2/log3; both points scale by it
    assert t1.t_verify / t1.t_1 == pytest.approx(3 ** (0.6309), rel=1e-3)


def test_table_validation():
    with pytest.raises(PolicyError):
        TimingTable.of()
    with pytest.raises(PolicyError):
        TimingTable.of(B1, Timings(t_1=1.0, t_verify=1.0, t_head=0.1, k=3, batch_size=2))
    with pytest.raises(PolicyError):
        TimingTable.of(B1, B1)
