"""The cost model prices every forward a cycle runs (verify, head drafts, replays)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from melix_fsm.policy.cost_model import CycleForwards, Timings, TimingTable, replay_rate
from melix_fsm.policy.decision import decide
from melix_fsm.policy.errors import PolicyError

from .conftest import BANDWIDTH_BOUND, PRIOR

T = Timings(t_1=10.0, t_verify=12.0, t_head=2.0, k=2, t_replay=9.0)


def test_the_cost_is_the_sum_of_the_forward_list():
    assert T.cost(CycleForwards()) == pytest.approx((12 + 2 * 2) / 10)
    assert T.cycle_cost == T.cost(CycleForwards())  # no replay: the old figure
    assert T.cost(CycleForwards(replay=0.5)) == pytest.approx((12 + 4 + 0.5 * 9) / 10)
    assert T.cost(CycleForwards(verify=1, head=0, replay=1)) == pytest.approx((12 + 9) / 10)
    # a replay not measured is priced as a verify (the most it can re-run is k+1 tokens)
    unmeasured = Timings(t_1=10.0, t_verify=12.0, t_head=2.0, k=2)
    assert unmeasured.cost(CycleForwards(replay=1)) == pytest.approx((12 + 4 + 12) / 10)


def test_replay_rate_is_the_chance_some_row_rejects():
    assert replay_rate(1.0, 2, 4) == 0.0 and replay_rate(0.0, 1) == 1.0
    assert replay_rate(0.8, 2) == pytest.approx(1 - 0.64)
    assert replay_rate(0.8, 2, 3) == pytest.approx(1 - 0.8**6)  # any row replays the batch


@given(st.floats(0.0, 1.0), st.integers(1, 4), st.integers(1, 8))
def test_counting_the_replay_never_raises_the_predicted_speedup(a, k, rows):
    t = Timings(t_1=1.0, t_verify=1.1, t_head=0.1, k=k, batch_size=rows)
    with_replay = decide(t, "auto", PRIOR, forwards=CycleForwards(replay=replay_rate(a, k, rows)))
    without = decide(t, "auto", PRIOR)
    assert with_replay.predicted_speedup <= without.predicted_speedup
    assert with_replay.cycle_cost >= without.cycle_cost and with_replay.replay_rate == replay_rate(a, k, rows)


def test_decide_records_the_forward_list_it_priced():
    d = decide(BANDWIDTH_BOUND, "auto", PRIOR, forwards=CycleForwards(replay=1.0))
    assert d.replay_rate == 1.0
    assert d.cycle_cost == pytest.approx(BANDWIDTH_BOUND.cost(CycleForwards(replay=1.0)))
    assert d.predicted_speedup == pytest.approx(d.expected_tokens / d.cycle_cost)


def test_timing_table_prices_other_depths_off_its_curve():
    table = TimingTable.of(Timings(t_1=1.0, t_verify=1.5, t_head=0.1, k=3, batch_size=1))
    t1, _ = table.at(1, 1)
    t3, extrapolated3 = table.at(1, 3)
    t5, extrapolated5 = table.at(1, 5)
    assert t3.t_verify == 1.5 and not extrapolated3 and t1.k == 1
    assert 1.0 <= t1.t_verify <= 1.5 and t5.t_verify >= 1.5 and extrapolated5
    assert t1.t_head == t3.t_head == 0.1
    with pytest.raises(PolicyError):
        table.at(1, 0)


def test_bad_forward_lists_and_replay_times_are_typed():
    with pytest.raises(PolicyError):
        CycleForwards(replay=-1.0)
    with pytest.raises(PolicyError):
        Timings(t_1=1.0, t_verify=1.0, t_head=0.1, k=1, t_replay=float("nan"))
